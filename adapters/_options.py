"""The words every adapter takes, declared once: what to select, and how to assign.

``**selection: Unpack[SelectionWords]`` and ``**words: Unpack[AssignWords]`` in each adapter's
signature, made into a :class:`Selection` or :class:`AssignOptions`, so mypy checks every call
and every adapter means the same by ``scope``, ``include``, ``trainable_only``, ``also``,
``strict`` and ``cast``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypedDict, TypeVar

from weightstore.core._words import refuse_unknown_words
from weightstore.core.keys import (
    MappingRules,
    Patterns,
    passes,
    plan_outward,
    require_matches,
)
from weightstore.errors import SelectionError


class SelectionWords(TypedDict, total=False):
    """The keyword arguments every export takes (``tf2.export(model, scope=..., include=...)``).

    Each adapter's ``export`` declares ``**selection: Unpack[SelectionWords]`` and makes a
    :class:`Selection` of them, so the words, their types and their defaults are the same in
    every adapter, the hooks and the CLI; mypy checks every call. The fields of
    :class:`Selection` are these words (a test holds the two to one list).
    """

    scope: str | None
    include: Patterns
    exclude: Patterns
    trainable_only: bool
    also: Patterns


class AssignWords(SelectionWords, total=False):
    """The keyword arguments every assign takes: :class:`SelectionWords` plus :class:`AssignOptions`'s own."""

    mapping: MappingRules
    strict: bool
    cast: bool
    skip_unchanged: bool | None


_Options = TypeVar("_Options", bound="Selection")


@dataclass(frozen=True)
class Selection:
    """Which variables an export or assign sees; the same words in every adapter.

    ``scope``: only variables under it (keys relative to it); ``include``/``exclude``: patterns
    on those relative keys; ``trainable_only``: only trainable ones, plus those matching ``also``.
    """

    scope: str | None = None
    include: Patterns = None
    exclude: Patterns = None
    trainable_only: bool = False
    also: Patterns = None

    @classmethod
    def of(cls: type[_Options], called: str, words: Mapping[str, Any],
           takes: Callable[..., object] | None = None) -> _Options:
        """These options from the keywords the user gave ``called`` (``"tf2.assign"``, the function
        ``takes`` where it has parameters of its own): a word that is none of them is a
        ``TypeError`` naming ``called``, not this class, with a close match among the options and
        ``takes``'s parameters (:func:`~weightstore.core._words.refuse_unknown_words`)."""
        refuse_unknown_words(called, words, [field.name for field in fields(cls)], takes)
        return cls(**words)

    def keeps(self, key: str, trainable: bool) -> bool:
        """The ``trainable_only`` rule for a variable with scope-relative ``key``."""
        return keeps(key, trainable, self.trainable_only, self.also)

    def choose(self, keys: Iterable[str], trainable: Callable[[str], bool], where: str = "", *,
               mapping: MappingRules = None, command_line: bool = False) -> dict[str, str]:
        """Output key -> key of what these words keep of ``keys``, the one rule every export follows.

        ``scope``, ``mapping``, ``include`` and ``exclude`` first (:func:`plan_outward`), then
        ``trainable_only`` with ``also`` on the output keys (``trainable`` is asked of a key of
        ``keys``). Each word must do something: an ``also`` that matches no key is refused, as
        is a ``trainable_only`` that keeps nothing of what the other words kept. ``where``
        describes what is not a file (``"the graph"``); ``command_line`` names the words as the
        ``ws`` command spells them (``--also``).
        """
        plan = plan_outward(keys, scope=self.scope, mapping=mapping, include=self.include, exclude=self.exclude,
                            where=where)
        if self.also:
            require_also_use(self.trainable_only)
            require_matches(plan.keys(), self.also, "--also" if command_line else "also", where)
        if not self.trainable_only:
            return plan
        chosen = {new: old for new, old in plan.items() if self.keeps(new, trainable(old))}
        if plan and not chosen:
            word = "--trainable-only" if command_line else "trainable_only"
            raise SelectionError(f"{word} keeps nothing{' of ' + where if where else ''}: "
                                 "every selected variable is non-trainable")
        return chosen

    def words(self) -> SelectionWords:
        """These options as the keyword arguments that make them, to pass on to an export."""
        return SelectionWords(scope=self.scope, include=self.include, exclude=self.exclude,
                              trainable_only=self.trainable_only, also=self.also)


@dataclass(frozen=True)
class AssignOptions(Selection):
    """A :class:`Selection` plus how values become variables' contents.

    ``mapping`` renames the dictionary's keys before pairing; ``strict`` refuses any missing,
    unexpected or mismatched key without changing a variable; ``cast`` allows dtype conversions
    that round, never one out of the target's range (:func:`out_of_range`); ``skip_unchanged``
    (``None``: only for versions) leaves alone variables that last received the very same bytes.
    """

    mapping: MappingRules = None
    strict: bool = True
    cast: bool = False
    skip_unchanged: bool | None = None

    def assign_words(self) -> AssignWords:
        """These options as the keyword arguments that make them, to pass on to an assign."""
        return AssignWords(**self.words(), mapping=self.mapping, strict=self.strict, cast=self.cast,
                           skip_unchanged=self.skip_unchanged)


def require_also_use(trainable_only: bool) -> None:
    """``also`` adds to what ``trainable_only`` keeps; without it every variable is kept, and an
    ``also`` that does nothing would hide a forgotten ``trainable_only`` (the ``ws`` command
    refuses ``--also`` alone as a usage error before this)."""
    if not trainable_only:
        raise SelectionError("also= adds non-trainable variables to what trainable_only=True keeps; pass "
                             "trainable_only=True too (without it every variable is kept already)")


def keeps(key: str, trainable: bool, trainable_only: bool, also: Patterns) -> bool:
    """The ``trainable_only`` rule: trainable variables, plus those whose key matches ``also``."""
    return trainable or not trainable_only or (bool(also) and passes(key, also))
