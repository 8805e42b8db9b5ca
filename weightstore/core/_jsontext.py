"""JSON a file brings, bounded before it is parsed and strict when it is.

Every JSON text weightstore reads from a file is first held to :func:`refuse_dense`, which
bounds what parsing it can make Python allocate. :func:`loads` parses those with no faster
parser of their own (a safetensors header, a Hugging Face index, a ``.keras`` config, a
version folder's ``LATEST`` and intent record): an object naming one key twice is refused
(which of the two a reader takes is the reader's whim, and the spec forbids it), as are NaN
and Infinity, which no strict JSON writer can write back (``ws ls --json``, a converted file's
metadata). Text as compact JSON writers write it (orjson, serde_json: the safetensors
library's headers and ours) is parsed by orjson and proved free of repeated names by writing
it back byte for byte; any other text goes to the stdlib parser, which looks at each object.
A manifest and a shard index, which only weightstore writes and reads and which may list 100,000
tensors, are parsed by orjson after :func:`refuse_dense`: a key named twice there
takes its last value (docs/security.md).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from weightstore.core.limits import MAX_JSON_DEPTH
from weightstore.errors import FormatError, UnsafeFileError, short_repr

__all__ = ["refuse_dense", "loads", "too_deep", "refuse_deep", "text_field"]



def refuse_dense(text: str | bytes, min_bytes: int, what: str) -> None:
    """Refuse, before parsing, JSON text holding more than one object or array per ``min_bytes``
    (plus a few): Python spends 56-64 bytes on each however short its text (``[]``: 2 bytes), so
    this bounds what the parse allocates to a few times the text. Brackets inside strings count
    too (counted in C, cheaper than any parse); text that dense is no real manifest or header.
    ``text`` may be the encoded bytes, counted without decoding them."""
    containers = (text.count(b"{") + text.count(b"[") if isinstance(text, bytes)
                  else text.count("{") + text.count("["))
    if containers > len(text) // min_bytes + 1024:
        raise UnsafeFileError(f"{what} is not JSON weightstore parses: it holds {containers} JSON objects and arrays "
                              f"in {len(text)} bytes (at most one per {min_bytes} bytes)")


def loads(text: str | bytes, *, what: str, min_bytes: int, nonfinite: bool = False) -> Any:
    """The document ``text`` holds, after :func:`refuse_dense` with ``min_bytes``; refused with
    a :class:`FormatError` (:class:`UnsafeFileError` for a key named twice) that calls the text
    ``what``. ``nonfinite`` accepts NaN and Infinity, for texts their writers make with Python's
    ``json`` (a Keras config)."""
    refuse_dense(text, min_bytes, what)
    document = _canonical(text)
    if document is not _NOT_CANONICAL:
        return document
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{what} is not UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_object,
                          parse_constant=_accept_constant if nonfinite else _refuse_constant)
    except _DuplicateName as exc:
        raise UnsafeFileError(f"{what} names {short_repr(exc.args[0])} twice") from None
    except (ValueError, RecursionError) as exc:  # the parser's own messages are one short line
        raise FormatError(f"{what} is not JSON ({exc})") from None


#: what :func:`_canonical` returns for text it leaves to the stdlib parser (``None`` is JSON's null)
_NOT_CANONICAL = object()


def _canonical(text: str | bytes) -> Any:
    """The document ``text`` holds if orjson writes it back as exactly that text (trailing
    spaces aside: a safetensors header's padding), else :data:`_NOT_CANONICAL`.

    Written back, a document names each key once, so text equal to it names none twice; and
    orjson reads no NaN, Infinity, lone surrogate or invalid UTF-8, writes nothing nested past
    254 levels (so no value reaches ``repr``'s recursion limit), and writes a float where the
    text held an integer past 64 bits. One C parse and one C write, where the
    stdlib's ``object_pairs_hook`` costs a Python call per object (a header of 100 tensors:
    0.1 ms of a 0.9 ms open). Fast twin of the stdlib parse below, which is the rule; bound
    by ``tests/test_fast_paths.py::test_json_reads_alike_as_written_and_otherwise``."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if not _looks_compact(raw):
        return _NOT_CANONICAL
    try:
        document = orjson.loads(raw)
        written = orjson.dumps(document)
    except (ValueError, TypeError):  # orjson's errors: not JSON it reads, nesting past 254 it writes
        return _NOT_CANONICAL
    return document if written == raw.rstrip(b" ") else _NOT_CANONICAL


def _looks_compact(raw: bytes) -> bool:
    """Whether ``raw`` may be compact JSON, from a look at its start: text indented or spaced by
    its writer (an HF index, a Keras config, Python's ``json.dumps``: ``{\\n`` or ``": "``
    after the first name) never is, and would pay an orjson parse and write for nothing. Only
    ever sends text to the stdlib parser, which is the rule, so a wrong guess costs time alone."""
    if raw[1:2].isspace():
        return False
    colon = raw.find(b'":', 0, 4096)
    return colon < 0 or raw[colon + 2 : colon + 3] != b" "


class _DuplicateName(Exception):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that refuses a JSON object naming one key twice."""
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _DuplicateName(name)
            seen.add(name)
    return document


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _accept_constant(name: str) -> float:
    return float(name)


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` nests mappings, lists and tuples (JSON's objects and arrays, as parsed
    or as a caller built them) more than ``limit`` levels deep. Not recursive, and linear in the
    containers it holds."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return False


def refuse_deep(value: Any, what: str) -> None:
    """Refuse with a :class:`FormatError` a parsed value nested deeper than :data:`MAX_JSON_DEPTH`."""
    if too_deep(value):
        raise FormatError(f"{what} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep")


def text_field(document: dict[str, Any], name: str, what: str) -> str:
    """A string field of a parsed document (``created``, ``producer``), ``""`` where absent;
    anything else is refused with a :class:`FormatError` rather than shown with ``str()``, which
    a value nested 1,000 deep makes raise RecursionError."""
    value = document.get(name, "")
    if not isinstance(value, str):
        raise FormatError(f"{what} {name!r} is not a string but {type(value).__name__}")
    return value
