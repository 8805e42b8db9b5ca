"""A keyword argument nothing takes, refused in the words of the function the user called.

Python's own ``TypeError`` for ``ws.load(path, scop="x")`` names no close match, and an
adapter's ``tf2.assign(model, path, scop="x")``, whose words go through ``**words`` into
:class:`~weightstore.adapters.plan.AssignOptions`, named that internal class instead of the
call. :func:`refuse_unknown_words` is the one check both use: the options' constructor
(``Selection.of``) for the adapters, hooks and follower, told the verb so that a typo of the
verb's own parameter is matched too, and :func:`checks_words` for the store and sync verbs.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Collection, Iterable
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


def refuse_unknown_words(called: str, given: Iterable[str], known: Collection[str],
                         takes: Callable[..., object] | None = None) -> None:
    """Raise ``TypeError`` naming ``called`` (``"tf2.assign"``) and the first of ``given`` not in
    ``known``, with "did you mean" for a close match (as click does). ``takes``: the function
    that swallowed ``given`` into ``**words``, whose own parameters are close matches too
    (``optimzer`` for ``tf2.assign``'s ``optimizer``, which Python bound before the words)."""
    for word in given:
        if word not in known:
            near = sorted({*known, *(_keywords(takes) if takes is not None else ())})
            close = difflib.get_close_matches(word, near, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{called}() got an unexpected keyword argument {word!r}{hint}")


def _keywords(function: Callable[..., object]) -> frozenset[str]:
    """The parameters of ``function`` a caller may give by keyword."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(name for name, parameter in inspect.signature(function).parameters.items()
                     if parameter.kind in kinds)


def checks_words(called: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a public function so that a keyword it does not take is refused by
    :func:`refuse_unknown_words` as ``called`` (``"ws.load"``), before the call."""

    def decorate(function: Callable[_P, _R]) -> Callable[_P, _R]:
        known = _keywords(function)

        @functools.wraps(function)
        def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if not known.issuperset(kwargs):
                refuse_unknown_words(called, kwargs, known)
            return function(*args, **kwargs)

        return checked

    return decorate
