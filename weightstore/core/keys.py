"""Keys, scopes, selections and mappings: the vocabulary every other module speaks.

A key is a scope path (``model_001/conv_1/bn/beta``). Scopes match whole segments, so
``model_1`` never matches ``model_10/w`` (the classic ``startswith`` bug). Everything here is
pure and works on any mapping, so the API, the adapters and the CLI share one meaning of
each word.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
import unicodedata
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TypeVar

from weightstore.core.limits import MAX_KEY_BYTES
from weightstore.errors import InvalidKeyError, SelectionError, short_repr

V = TypeVar("V")
Patterns = str | Sequence[str] | None
MappingRules = Mapping[str, str] | Sequence[str] | None

RESERVED_PREFIX = "__weightstore"
_GLOB_CHARS = frozenset("*?[")
#: how a mapping rule's FROM (and TO) names the end of a key, not its scope: ``*/ExponentialMovingAverage=*``
_ENDING = "*/"
#: keys a mapping rule that matches none shows of the keys it was given, for their naming
_KEYS_SHOWN = 3
#: C0, DEL and C1 controls (U+0080-U+009F), which terminals interpret rather than print
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_MISPRINTING = frozenset({"Cc", "Cf", "Zl", "Zp"})  # Unicode categories: see misprints()
#: TensorFlow's output suffix ending a tensor name (``dense/kernel:0``); never part of a key
OUTPUT_SUFFIX = re.compile(r":\d+$")
#: C0 controls but NUL (the separator) and DEL, as bytes for ``bytes.translate`` to strike out
_CONTROL_BYTES = bytes(range(1, 32)) + b"\x7f"
#: a '.' or '..' that a separator (or the end) follows: a dot segment if one precedes it too
_DOT_BEFORE_SEPARATOR = re.compile(r"\.\.?(?![^\0/])")
_OUTPUT_SUFFIX_BEFORE_SEPARATOR = re.compile(r":\d+(?:\0|$)")


def from_tf_name(name: str) -> str:
    """A TensorFlow variable name as a key: empty and ``.`` segments dropped.

    TF allows ``model_001//conv_1/kernel`` (a nested ``variable_scope("")``) and
    ``./conv_1/kernel`` (``variable_scope(".")``); a key has neither segment, and each reads as
    a path would, ``model_001/conv_1/kernel`` and ``conv_1/kernel``. Two names that collapse to
    one key are an error wherever both appear (the TF1 adapter, TF1 checkpoints). A ``..``
    segment stays: dropping it would not read as a path does, so such a name makes no key.
    """
    return "/".join(segment for segment in name.split("/") if segment and segment != ".")


def validate_key(key: object) -> str:
    """Return ``key`` if it is a valid key, else raise :class:`InvalidKeyError` naming it."""
    if not isinstance(key, str):  # shown cut short: a manifest's 'keys' may hold any JSON value, nested 1,024 deep
        raise InvalidKeyError(f"invalid key: {short_repr(key)} is not a string")
    problem = _key_problem(key)
    if problem:
        raise InvalidKeyError(f"invalid key: {problem}", key=key)
    return key


def validate_keys(keys: Iterable[object]) -> list[str]:
    """:func:`validate_key` for many keys at once; the keys as a list.

    A file may hold 50,000 keys: rather than one call each, the keys are joined with NUL
    (which no valid key holds) and the rules are checked with a few scans of the joined text.
    Only when a scan finds something, or a key is not ASCII (NFC and format characters are
    per-key questions), are the keys checked one by one, which names the first bad key.
    """
    keys = list(keys)
    try:
        joined = "\0".join(keys)  # type: ignore[arg-type]  # a non-str is refused below
    except TypeError:
        joined = None
    if (joined is None or _maybe_invalid(joined, len(keys))
            or len(joined) > MAX_KEY_BYTES and max(map(len, keys), default=0) > MAX_KEY_BYTES):  # type: ignore[arg-type]
        for key in keys:
            validate_key(key)
    return keys  # type: ignore[return-value]  # every one was checked to be a str


def _maybe_invalid(joined: str, count: int) -> bool:
    """Whether ``count`` keys joined by NUL might break a rule of :func:`_key_problem`; False
    only when none does. Substring searches and literal-first patterns only: a pattern that
    starts with an alternation is tried at every position, 90 ms for 50,000 keys.

    Fast twin of :func:`_key_problem`, which is the rule (and names what is wrong). Bound by
    the differential test ``tests/test_fast_paths.py::test_the_bulk_key_check_refuses_exactly_what_the_per_key_rule_refuses``
    (and ``tests/test_keys.py::test_many_keys_at_once_refuse_the_same_keys_as_one_at_a_time``)."""
    if not joined.isascii() or joined.count("\0") != count - 1 or "\\" in joined or "__weightstore" in joined:
        return True
    if joined.startswith(("/", "\0")) or joined.endswith(("/", "\0")) or not joined:
        return True
    if "//" in joined.replace("\0", "/"):  # an empty segment or key: '//', NUL NUL, NUL '/', '/' NUL, in one search
        return True
    raw = joined.encode("ascii")
    if len(raw.translate(None, _CONTROL_BYTES)) != len(raw):
        return True
    # each pattern only where its first character is (a search for one character costs a tenth of a pattern's)
    return bool("." in joined and _DOT_BEFORE_SEPARATOR.search(joined)
                or ":" in joined and _OUTPUT_SUFFIX_BEFORE_SEPARATOR.search(joined))


@functools.lru_cache(maxsize=1 << 16)  # the same keys are checked on every open and assign
def _key_problem(key: str) -> str | None:
    """What makes ``key`` invalid, in words; ``None`` for a valid key. The rule; its fast twin
    for many keys at once is :func:`_maybe_invalid`."""
    if not key:
        return "it is empty"
    if key.startswith("/") or key.endswith("/"):
        return "it starts or ends with '/'"
    if "\\" in key:
        return "it contains a backslash"
    if _CONTROL.search(key):
        return "it contains a control character"
    if not key.isascii():
        problem = _unicode_problem(key)
        if problem:
            return problem
    elif len(key) > MAX_KEY_BYTES:
        return f"it is {len(key)} bytes of UTF-8; an npz member name holds at most {MAX_KEY_BYTES}"
    if (suffix := OUTPUT_SUFFIX.search(key)) is not None:
        return f"TensorFlow's output suffix ({suffix.group()!r}) is not part of a key; drop it"
    for segment in key.split("/"):
        if segment == "":
            return "it has an empty segment ('//')"
        if segment in (".", ".."):
            return f"it has a {segment!r} segment"
        if segment.startswith(RESERVED_PREFIX):
            return f"segments starting with {RESERVED_PREFIX!r} are reserved"
    return None


def misprints(char: str) -> bool:
    """Whether a terminal would act on ``char`` or show it as something else: a control
    character (C0, C1: ESC starts a terminal's commands), a format character (bidi overrides,
    zero-width joiners, a BOM: a key holding one prints as another key), a line or paragraph
    separator. Keys hold none of them (:func:`validate_key`); text from a file may."""
    return unicodedata.category(char) in _MISPRINTING


def _unicode_problem(key: str) -> str | None:
    """Why a non-ASCII key is refused: one name must have one spelling, and print as itself."""
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "it contains a lone surrogate (not valid Unicode text)"
    if size > MAX_KEY_BYTES:
        return f"it is {size} bytes of UTF-8; an npz member name holds at most {MAX_KEY_BYTES}"
    # Format characters (bidi overrides, zero-width joiners, BOM) make a key print as another one.
    invisible = next((c for c in key if unicodedata.category(c) == "Cf"), None)
    if invisible is not None:
        return f"it contains the invisible format character U+{ord(invisible):04X}"
    if not unicodedata.is_normalized("NFC", key):
        nfc = unicodedata.normalize("NFC", key)
        return f"it is not in Unicode NFC form ({ascii(key)}); write it as {nfc!r} ({ascii(nfc)})"
    return None


@functools.lru_cache(maxsize=1024)  # patterns are normalized once per key they are matched against
def normalize_scope(scope: str | None) -> str:
    """A scope as users type it (``model_002/`` or ``None``) in canonical form.

    One trailing ``/`` is how people write a folder-like name, so ``dense/`` is ``dense``; a
    leading one would read as a root that keys do not have, so it is refused with the fix.
    """
    if scope is None:
        return ""
    if not isinstance(scope, str):
        raise InvalidKeyError(f"scope {scope!r} is not a string")
    trimmed = scope[:-1] if scope.endswith("/") else scope
    if trimmed.startswith("/") or trimmed.endswith("/"):
        reason = "it starts with '/'" if trimmed.startswith("/") else "it ends with '//'"
        fixed = trimmed.strip("/")
        raise InvalidKeyError(f"invalid scope {scope!r}: {reason} (one trailing '/' is allowed, a leading one is not)"
                              + (f"; write {fixed!r}" if fixed and not _key_problem(fixed) else ""))
    if trimmed:
        problem = _key_problem(trimmed)
        if problem:
            raise InvalidKeyError(f"invalid scope {scope!r}: {problem}")
    return trimmed


def in_scope(key: str, scope: str) -> bool:
    """Whether ``key`` is ``scope`` or lies under it, by whole segments."""
    return not scope or key == scope or key.startswith(scope + "/")


def strip_scope(key: str, scope: str) -> str:
    """``key`` relative to ``scope``; the inverse of :func:`join_scope`."""
    if not scope:
        return key
    if not key.startswith(scope + "/"):
        raise ValueError(f"key {key!r} is not under scope {scope!r}")
    return key[len(scope) + 1 :]


def join_scope(scope: str, key: str) -> str:
    return f"{scope}/{key}" if scope and key else scope or key


def is_glob(pattern: str) -> bool:
    return any(c in _GLOB_CHARS for c in pattern)


def matches(key: str, pattern: str) -> bool:
    """A glob matches the whole key (``*`` crosses ``/``); any other pattern is a scope."""
    if is_glob(pattern):
        return fnmatch.fnmatchcase(key, pattern)
    return in_scope(key, normalize_scope(pattern))


def _as_list(patterns: Patterns) -> list[str]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        return [patterns]
    return list(patterns)


def passes(key: str, include: Patterns = None, exclude: Patterns = None) -> bool:
    """``include`` (any of them; all keys when empty) minus ``exclude`` (any of them)."""
    includes, excludes = _as_list(include), _as_list(exclude)
    if includes and not any(matches(key, p) for p in includes):
        return False
    return not any(matches(key, p) for p in excludes)


def parse_mapping(mapping: MappingRules) -> list[tuple[str, str]]:
    """Ordered ``(FROM, TO)`` scope pairs from a dict or ``"FROM=TO"`` strings."""
    if mapping is None:
        return []
    if isinstance(mapping, str):
        mapping = [mapping]
    if isinstance(mapping, Mapping):
        pairs = list(mapping.items())
    else:
        pairs = []
        for rule in mapping:
            if not isinstance(rule, str) or "=" not in rule:
                raise InvalidKeyError(f"mapping rule {rule!r} is not of the form FROM=TO")
            source, target = rule.split("=", 1)
            pairs.append((source, target))
    rules = [(normalize_scope(s), normalize_scope(t)) for s, t in pairs]
    for source, target in rules:
        ending = source.startswith(_ENDING)
        if ending != (target == "*" or target.startswith(_ENDING)) or (
                ending and (is_glob(source[2:]) or is_glob(target[2:]))):
            raise InvalidKeyError(f"mapping rule {source}={target} is neither FROM=TO between scopes nor "
                                  "*/FROM=*/TO (or *) between the ends of keys")
    for i, (source, target) in enumerate(rules):  # the first rule of each kind that matches a key renames it
        for earlier, earlier_target in rules[:i]:
            if (earlier.startswith(_ENDING) == source.startswith(_ENDING)
                    and (source[1:].endswith(earlier[1:]) if source.startswith(_ENDING) else in_scope(source, earlier))):
                what = f"every key ending {earlier[1:]!r}" if earlier.startswith(_ENDING) else f"every key under {earlier!r}"
                raise SelectionError(f"mapping {source}={target} never applies: the earlier rule "
                                     f"{earlier}={earlier_target} renames {what} first; put the narrower rule first")
    return rules


def rule_matches(key: str, source: str) -> bool:
    """Whether a mapping rule's FROM matches ``key``: a scope it lies in, or ``*/END`` the
    whole segments it ends with (below at least one)."""
    return key.endswith(source[1:]) if source.startswith(_ENDING) else in_scope(key, source)


def map_key(key: str, rules: Sequence[tuple[str, str]], scope: str = "") -> str:
    """Rewrite ``key`` by the first scope rule it lies in (:func:`rule_matches`), then the
    result's end by the first ``*/END`` rule it ends with: ``net=model`` with
    ``*/ExponentialMovingAverage=*`` reads ``net/w/ExponentialMovingAverage`` as ``model/w``,
    and a scope rule naming a whole key (``net/d/kernel=head/k``, written before ``*/kernel=*/w``
    as narrower rules are) renames it as the file names it. ``key`` is relative to ``scope``: an
    error names the key as the file has it, scope and all."""
    return _end_mapped(_scope_mapped(key, rules, scope), rules)


def _scope_mapped(key: str, rules: Sequence[tuple[str, str]], scope: str = "") -> str:
    """``key`` with its prefix rewritten by the first scope rule it lies in, else as it is."""
    for source, target in rules:
        if not source.startswith(_ENDING) and in_scope(key, source):
            rest = "" if key == source else strip_scope(key, source)
            mapped = join_scope(target, rest)
            if not mapped:
                raise InvalidKeyError(f"mapping {source}={target} turns it into an empty key",
                                      key=join_scope(scope, key))
            return mapped
    return key


def _end_rule(key: str, rules: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """The first ``*/END`` rule ``key`` ends with; None when none does."""
    return next(((source, target) for source, target in rules
                 if source.startswith(_ENDING) and key.endswith(source[1:])), None)


def _end_mapped(key: str, rules: Sequence[tuple[str, str]]) -> str:
    """``key`` with its end rewritten by :func:`_end_rule`'s rule, else as it is."""
    rule = _end_rule(key, rules)
    return key if rule is None else join_scope(key[:len(key) - len(rule[0]) + 1], rule[1][2:])


def _endings_of(keys: Iterable[str]) -> list[str]:
    """Every ``*/END`` a key ends with, below at least one segment: what a ``*/`` rule might have meant."""
    names: set[str] = set()
    for key in keys:
        parts = key.split("/")
        names.update(_ENDING + "/".join(parts[i:]) for i in range(1, len(parts)))
    return sorted(names)


def scopes_of(keys: Iterable[str]) -> list[str]:
    """Every key and every scope above it: the names a user might have meant."""
    names: set[str] = set()
    for key in keys:
        parts = key.split("/")
        names.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(names)


def suggest(name: str, candidates: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` when a close match exists, else an empty string."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def closest(pattern: str, keys: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for a ``pattern`` that matched nothing: the closest key or scope.

    Unlike :func:`suggest`, something is always named: a glob like ``*/bn/moving_*`` that
    misses ``bn/moving_mean`` (a top-level layer) or ``batch_normalization/moving_mean`` (a
    default name) is a near miss difflib's usual cutoff does not see.
    """
    candidates = list(keys) if is_glob(pattern) else scopes_of(keys)
    close = difflib.get_close_matches(pattern, candidates, n=1, cutoff=0.0)
    return f"; did you mean {close[0]!r}?" if close else ""


def require_matches(keys: Collection[str], patterns: Patterns, word: str, where: str = "") -> None:
    """Raise :class:`SelectionError` for the first of ``patterns`` that matches none of ``keys``.

    A word that matches nothing is nearly always a typo or a wrong guess at a name, and
    ignoring it loses exactly what it was written to keep (``also="*/bn/moving_*"``: the
    batch-norm statistics). ``word`` names the option in the message (``also``, ``include``);
    ``where`` describes what was searched when it is no file (``"the graph"``); a file is
    named by the caller, which wraps the call in :func:`weightstore.errors.naming`.
    """
    for pattern in _as_list(patterns):
        if not any(matches(key, pattern) for key in keys):
            raise SelectionError(f"{word} {pattern!r} matches no key{_where(where)}{closest(pattern, keys)}",
                                 word=f"{word} {pattern!r}")


def plan_outward(
    keys: Iterable[str],
    *,
    scope: str | None = None,
    mapping: MappingRules = None,
    include: Patterns = None,
    exclude: Patterns = None,
    where: str = "",
) -> dict[str, str]:
    """New key -> source key for reading out: keep under ``scope`` and strip it, map, select.

    A key equal to the scope itself has no name relative to it and is left out. ``where`` is as
    for :func:`require_matches`: a description of what is not a file (``"Sequential 'net'"``).
    """
    norm_scope = normalize_scope(scope)
    rules = parse_mapping(mapping)
    source_keys = list(keys)
    under = [k for k in source_keys if not norm_scope or k.startswith(norm_scope + "/")]
    if norm_scope and not under and source_keys:
        raise unmatched_scope(norm_scope, source_keys, where)
    if rules:
        relative = [strip_scope(k, norm_scope) for k in under]
        _require_rules_match(relative, rules, where)
        renamed, under = _renamed(relative, under, rules, norm_scope)
    else:  # the common case, without a call per key: 50,000 keys
        cut = len(norm_scope) + 1 if norm_scope else 0
        renamed = {k[cut:]: k for k in under} if cut else dict(zip(under, under, strict=True))
    _refuse_collisions(renamed, under, norm_scope, rules, where)
    return _select_or_fail(renamed, include, exclude, where)


def unmatched_scope(scope: str, keys: Collection[str], where: str = "") -> SelectionError:
    """The error for a (normalized) ``scope`` that no key lies under, hinting at the closest key
    or scope, or at ``include`` when the scope names a tensor: one wording for every command.

    Keys kept as PyTorch names (``members.1.0.weight``: ``ws.save`` of ``export(names="torch")``)
    are one segment each, so no ``/`` scope reaches them; the nearest of them by letters
    (``members.2.1.bias``) would mislead, so the hint says how to read or select them instead,
    in Python and with ``ws`` (whose readers take no ``names``: ``--include`` is its way)."""
    dotted = scope.replace("/", ".")
    torch_named = [key for key in keys if key.startswith(dotted + ".") and "/" not in key]
    if scope in keys:
        hint = f"; {scope!r} is a tensor, not a scope: select it with include={scope!r}"
    elif torch_named:  # read so, the keys join with '/' whatever the user's spelling (members.1)
        hint = (f"; its keys are PyTorch state_dict names ({torch_named[0]!r}): read the file with names='torch' "
                f"(ws.load, ws.open) and scope {dotted.replace('.', '/')!r}, or select them as they are with "
                f"include='{dotted}.*' (ws ls, ws export: --include '{dotted}.*')")
    else:
        hint = suggest(scope, scopes_of(keys))
    return SelectionError(f"scope {scope!r} matches no key{_where(where)}{hint}", word=f"scope {scope!r}")


def plan_inward(
    keys: Iterable[str],
    *,
    scope: str | None = None,
    mapping: MappingRules = None,
    include: Patterns = None,
    exclude: Patterns = None,
    where: str = "",
) -> dict[str, str]:
    """New key -> source key for writing in: map, select (scope-relative), then put under ``scope``."""
    norm_scope = normalize_scope(scope)
    rules = parse_mapping(mapping)
    source_keys = list(keys)
    _require_rules_match(source_keys, rules, where)
    renamed, source_keys = _renamed(source_keys, source_keys, rules)
    _refuse_collisions(renamed, source_keys, "", rules, where)
    selected = _select_or_fail(renamed, include, exclude, where)
    return {join_scope(norm_scope, k): v for k, v in selected.items()}


def _require_rules_match(keys: list[str], rules: Sequence[tuple[str, str]], where: str) -> None:
    """Refuse a mapping rule whose FROM scope no key lies in: a typo there would leave the keys
    it was written to rename as they were, and the mistake would surface later, elsewhere.
    Without a close scope to suggest, the message shows the first keys, so that a user who
    guessed the file's naming (a Keras 3 ``.weights.h5`` keys ``layers/dense/vars/0``) can
    write the rule."""
    scoped = [_scope_mapped(key, rules) for key in keys] if any(s.startswith(_ENDING) for s, _ in rules) else keys
    for source, target in rules:
        ending = source.startswith(_ENDING)
        if keys and not any(rule_matches(key, source) for key in (scoped if ending else keys)):
            shown = ", ".join(map(repr, keys[:_KEYS_SHOWN])) + (", ..." if len(keys) > _KEYS_SHOWN else "")
            hint = suggest(source, _endings_of(scoped) if ending else scopes_of(keys)) or f"; its keys look like {shown}"
            raise SelectionError(f"mapping {source}={target} matches no key{_where(where)}{hint}",
                                 word=f"mapping {source}={target}")


def _renamed(keys: list[str], sources: list[str], rules: Sequence[tuple[str, str]],
             scope: str = "") -> tuple[dict[str, str], list[str]]:
    """New key -> source for ``keys`` (``sources`` as the file names them), and the sources kept.
    A name a ``*/END=*`` rule gives (the suffix removed) takes the place of the key it shadows
    (the same key without that suffix, as the file names it): with ``*/ExponentialMovingAverage=*``, ``w/ExponentialMovingAverage``
    is read as ``w`` and the raw ``w`` is not, as ``Saver(ema.variables_to_restore())`` restores
    a graph; a variable without a shadow keeps its own value. Any other rule's name meeting a
    key's is a collision, refused by :func:`_refuse_collisions`: ``*/gamma=*/scale`` beside a
    real ``bn/scale`` would drop one of them silently."""
    mapped = []
    for key, source in zip(keys, sources, strict=True):
        scoped = _scope_mapped(key, rules, scope)
        mapped.append((_end_mapped(scoped, rules), _end_rule(scoped, rules), key, source))
    # a shadow's new name -> the key it shadows, as the file names it (its end rule's suffix off)
    shadows = {new: _end_mapped(key, rules) for new, rule, key, _ in mapped if rule is not None and rule[1] == "*"}
    kept = [(new, source) for new, rule, key, source in mapped if rule is not None or shadows.get(new) != key]
    return {new: source for new, source in kept}, [source for _, source in kept]


def ends_by_rule(key: str, rules: Sequence[tuple[str, str]]) -> bool:
    """Whether a ``*/END`` rule rewrites ``key``'s end: one that names the key itself (an
    assign never leaves such a key out as training state)."""
    return _end_rule(_scope_mapped(key, rules), rules) is not None


def _refuse_collisions(renamed: dict[str, str], sources: list[str], scope: str, rules, where: str) -> None:
    if len(renamed) == len(sources):
        return
    seen: dict[str, str] = {}
    for source in sources:
        new = map_key(strip_scope(source, scope), rules)
        if new in seen:
            raise InvalidKeyError(
                f"keys {seen[new]!r} and {source!r} both become it{_where(where)}; "
                "change the mapping so each key has its own name", key=new
            )
        seen[new] = source


def _select_or_fail(renamed: dict[str, str], include: Patterns, exclude: Patterns, where: str) -> dict[str, str]:
    if include is None and exclude is None:
        return dict(renamed)
    if renamed:
        require_matches(renamed.keys(), include, "include", where)
    selected = {k: v for k, v in renamed.items() if passes(k, include, exclude)}
    if renamed and not selected and (_as_list(include) or _as_list(exclude)):
        includes = [p for p in _as_list(include) if not is_glob(p)]
        hint = suggest(includes[0], scopes_of(renamed)) if includes else ""
        raise SelectionError(
            f"include {_as_list(include)} exclude {_as_list(exclude)} keeps no key{_where(where)}{hint}"
        )
    return selected


def _where(where: str) -> str:
    return f" in {where}" if where else ""


def select(weights: Mapping[str, V], include: Patterns = None, exclude: Patterns = None) -> dict[str, V]:
    """The entries of ``weights`` whose key passes ``include``/``exclude``; a new dict."""
    plan = _select_or_fail({k: k for k in weights}, include, exclude, "")
    return {k: weights[k] for k in plan}


def remap(weights: Mapping[str, V], *, mapping: MappingRules = None, scope: str | None = None) -> dict[str, V]:
    """``weights`` renamed by ``mapping`` and then put under ``scope``; a new dict."""
    plan = plan_inward(weights, scope=scope, mapping=mapping)
    for key in plan:
        validate_key(key)
    return {new: weights[old] for new, old in plan.items()}
