"""How ``tf2.export`` names Keras layers in keys, shared by the live-model walk (``adapters.tf2``)
and the config walk of a ``.keras`` archive (:mod:`weightstore.formats._keras_keys`), so the
two give one model the same keys.

Keras names a layer ``<snake-cased class>`` or ``<snake-cased class>_<n>`` from one counter
per process (``Bidirectional`` names its copies ``forward_<name>`` and ``backward_<name>``),
so the first model built in a process shows ``dense``, ``dense_1``… and a second ``dense_2``,
``dense_3``…. :class:`Ranking` ranks the automatic names under one root by that counter and
the rank replaces it: the numbering Keras would have given had this been the first model of
the process. Names the user chose are kept; siblings that still share a segment (a ``Conv2D``
the user named ``dense`` beside an automatic ``dense_7``) are told apart by :func:`deduplicated`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping

#: an automatic name's counter: ASCII digits only (``\\d`` takes ``٣``), and few enough that
#: ``int`` never meets its digit limit on a hostile name
_NUMBER = re.compile(r"_([0-9]{1,18})")
_COPY_PREFIXES = ("forward_", "backward_")

#: ``(prefix, base, n)``: ``dense_3`` is ``("", "dense", 3)``, a Bidirectional's ``backward_lstm`` ``("backward_", "lstm", 0)``
Automatic = tuple[str, str, int]


@functools.lru_cache(maxsize=1024)
def snake_case(class_name: str) -> str:
    """Keras's ``naming.to_snake_case``: the stem of its automatic names and of its saved paths
    (cached: one class is asked for once per layer)."""
    name = re.sub(r"\W+", "", class_name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def automatic(name: str, class_name: str, *, copy: bool) -> Automatic | None:
    """``(prefix, base, n)`` where Keras made ``name`` up for a layer of ``class_name``, else None.
    ``copy``: the layer is one a ``Bidirectional`` made, the only kind whose ``forward_`` or
    ``backward_`` prefix is Keras's (a ``forward_dense`` of the user's own is a chosen name)."""
    base = snake_case(class_name)
    prefix = next((p for p in _COPY_PREFIXES if name.startswith(p)), "") if copy else ""
    rest = name[len(prefix):]
    if rest == base:
        return prefix, base, 0
    if not rest.startswith(base) or (match := _NUMBER.fullmatch(rest, len(base))) is None:
        return None
    return prefix, base, int(match.group(1))


class Ranking:
    """The automatic names of one root's layers (each parsed once, by the caller), ranked per base."""

    def __init__(self, parsed: Iterable[Automatic | None]):
        numbers: dict[str, set[int]] = {}
        for found in parsed:
            if found is not None:
                numbers.setdefault(found[1], set()).add(found[2])
        self._rank = {base: {n: i for i, n in enumerate(sorted(found))} for base, found in numbers.items()}

    def segments(self, siblings: Iterable[tuple[str, Automatic | None]]) -> list[str]:
        """The key segments of one parent's layers, given as ``(name, automatic(name))`` in the parent's order."""
        names = [name if parsed is None else self.name(parsed) for name, parsed in siblings]
        if len(set(names)) == len(names):
            return names
        return deduplicated((name, name) for name in names)  # siblings sharing a name: _1, _2…

    def name(self, parsed: Automatic) -> str:
        """An automatic name as its number ranks among its base's over the root (``dense_3``,
        the root's second dense: ``dense_1``)."""
        prefix, base, number = parsed
        rank = self._rank[base][number]
        return f"{prefix}{base}" if rank == 0 else f"{prefix}{base}_{rank}"


def deduplicated(items: Iterable[tuple[str, str]]) -> list[str]:
    """Sibling segments from ``(name, base)`` pairs: chosen names kept, automatic ones (``base`` or
    ``base_<n>``) renumbered in the parent's order past the chosen ones, so no two siblings share one."""
    marked = [(name, base, name == base or (name.startswith(base) and _NUMBER.fullmatch(name, len(base)) is not None))
              for name, base in items]
    taken = {name for name, _, is_automatic in marked if not is_automatic}
    used: set[str] = set()
    segments = []
    for name, base, is_automatic in marked:
        segment = _unused(base, taken) if is_automatic else _unused(name, taken) if name in used else name
        taken.add(segment)
        used.add(segment)
        segments.append(segment)
    return segments


def _unused(base: str, taken: set[str]) -> str:
    if base not in taken:
        return base
    n = 1
    while f"{base}_{n}" in taken:
        n += 1
    return f"{base}_{n}"


#: a key segment ``<base>_<n>``, as Keras numbers an automatic name (``dense_3``)
_NUMBERED = re.compile("(.+)" + _NUMBER.pattern)


def as_own_root(keys: Iterable[str]) -> dict[str, str]:
    """Keys of one part of a larger model, as the larger model numbers its layers
    (``sequential_1/dense_3/kernel``) -> the key the part gives it as its own root
    (``sequential/dense/kernel``), for each key the two differ in.

    The part's own keys rank each automatic name's number among those of its base over the
    whole root (:class:`Ranking`); ranking the layer segments of the keys the same way gives
    them. Chosen names that look numbered (``layer_2`` beside ``layer_10``) rank too, and keys
    of some of the part's layers rank as if those were all it had (``dense_3`` alone ranks
    ``dense``): a caller takes the renaming only where it :func:`pairs`.
    """
    parsed = {key: [_as_numbered(segment) for segment in key.split("/")[:-1]] for key in keys}
    ranking = Ranking(found for segments in parsed.values() for found in segments)
    renames = {}
    for key, segments in parsed.items():
        renamed = "/".join([*map(ranking.name, segments), key.rsplit("/", 1)[-1]])
        if renamed != key:
            renames[key] = renamed
    return renames


def pairs(given: Iterable[tuple[str, tuple[int, ...]]], targets: Mapping[str, tuple[int, ...]], *,
          whole: bool) -> bool:
    """Whether each ``(key, shape)`` of ``given`` names a target of its shape, no two the same one,
    and, where ``whole``, every target is named: the rule a renaming by :func:`as_own_root` is
    taken by. ``whole`` where the renaming was ranked from ``given``'s own keys (``tf2.assign``):
    only all of a part's keys rank as the part numbers itself, and a subset's ranking would pair
    values with other layers' variables of the same shape."""
    named: set[str] = set()
    for key, shape in given:
        if key in named or targets.get(key) != tuple(shape):
            return False
        named.add(key)
    return not whole or len(named) == len(targets)


def _as_numbered(segment: str) -> Automatic:
    """``dense_3`` -> ``("", "dense", 3)``; ``dense`` -> ``("", "dense", 0)``: Keras's first of a base has no number."""
    match = _NUMBERED.fullmatch(segment)
    return ("", match.group(1), int(match.group(2))) if match else ("", segment, 0)
