"""Each fast path against the rule it stands in for, on inputs built to find where they differ.

The checks that make 50,000 small tensors cheap are second implementations: a bulk key check
(``keys._maybe_invalid``) before the per-key rule (``keys._key_problem``), a column-wise parse
of version 1 manifest entries (``manifest._parse_plain_entries``) before the entry-by-entry
one (``manifest._parse_entries``), the manifest's integer columns checked as Python lists
for a few tensors (``_tensortable.FEW_ROWS``) rather than as numpy arrays, JSON from a file
read by orjson where it writes the text back unchanged (``_jsontext._canonical``), a safetensors
header's entries checked column by column (``safetensors._plain_tensors``), and a file's torch
names made keys all at once (``names.keys_of_torch_names``). The rule is the slow twin; the fast one may only ever say
"nothing to find here" when the rule agrees. (The npz directory and batch read have theirs in
``test_npz_fastpath.py::test_damaged_directories_read_alike_on_either_path``.)
"""

from __future__ import annotations

import math
from unittest.mock import patch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightstore import errors
from weightstore.core import _jsontext, _tensortable, manifest
from weightstore.core import keys as K
from weightstore.core.names import key_of_torch_name, keys_of_torch_names
from weightstore.formats import safetensors

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: pieces that each break, or nearly break, one rule of a key
_PIECES = st.sampled_from(["a", "w", "0", "/", "//", ".", "..", "./", "/.", ":", ":0", ":12/", "\\", "\0", "\n", "\x7f",
                           "\x1f", "__weightstore", "__weightstore_value__", "é", "e\u0301", "\u202e", "\ufeff", "层",
                           " ", "x" * 300])
KEY = st.lists(_PIECES, min_size=0, max_size=6).map("".join)


def problem(key: str) -> str | None:
    try:
        K.validate_key(key)
    except errors.InvalidKeyError as exc:
        return str(exc)
    return None


@SETTINGS
@given(st.lists(KEY, min_size=1, max_size=5))
def test_the_bulk_key_check_refuses_exactly_what_the_per_key_rule_refuses(keys):
    """``validate_keys`` passes a list only when every key passes ``validate_key``, and when it
    refuses, it names the first key the rule refuses, with the rule's words."""
    found = [text for text in map(problem, keys) if text is not None]
    if not K._maybe_invalid("\0".join(keys), len(keys)):
        assert not found, "the bulk scan said nothing to find, the rule found something"
    try:
        K.validate_keys(keys)
    except errors.InvalidKeyError as exc:
        assert found and str(exc) == found[0]
    else:
        assert not found


_DTYPES = st.sampled_from(["float32", "bfloat16", "int8", "complex64", "bool", "float128", "object", "", 3, None, ["f4"]])
_SIZES = st.one_of(st.integers(0, 5), st.sampled_from([-1, 2**40, 2**63, True, False, 2.0, "3", None]))
_SHAPES = st.one_of(st.lists(_SIZES, max_size=4), st.sampled_from([None, 3, "2", {}, [0] * 40]))
_DIGESTS = st.sampled_from([None, "crc32:0000abcd", "crc32:xyz", "crc32:", "md5:00", 5, ["crc32:0"]])
_ENTRY = st.one_of(
    st.fixed_dictionaries({"dtype": _DTYPES, "shape": _SHAPES, "checksum": _DIGESTS}),
    st.fixed_dictionaries({"dtype": _DTYPES, "shape": _SHAPES}),
    st.fixed_dictionaries({"dtype": _DTYPES, "shape": _SHAPES, "checksum": _DIGESTS,
                           "location": st.sampled_from(["/x", 3]), "codec": st.sampled_from(["shuffle-zstd", "?"])}),
    st.sampled_from([None, [], "float32", 3]),
)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["a", "b/w", "c"]), _ENTRY, min_size=1, max_size=3))
def test_version_1_entries_read_column_wise_as_entry_by_entry(raw):
    """``_parse_plain_entries`` either hands the entries over (``None``) or reads exactly what
    ``_parse_entries`` reads; whatever the rule refuses, it hands over."""
    fast = manifest._parse_plain_entries(raw)
    try:
        slow = manifest._parse_entries(raw, {}, {})
    except errors.FormatError:
        assert fast is None
        return
    assert fast is None or fast == slow


#: values at the edges of the integer columns' ranges, past 64 bits (which numpy refuses to hold), or no integers
_EDGES = st.sampled_from([-1, 3, 64, 65, 0xFFFFFFFF, 2**32, 2**62, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64,
                          True, 1.0, None, "1"])
_INTEGER = st.one_of(st.integers(-2, 6), _EDGES)
_SOME_INTEGERS = st.lists(_INTEGER, max_size=5)


@st.composite
def _columns(draw) -> dict:
    """Manifest columns for a few tensors, mostly well formed, with hostile values: integers
    past 64 bits, negative or out of range, shapes too large for any array (or with a zero
    dimension), unknown dtypes, keys twice or invalid, a column of the wrong length or type."""
    count = draw(st.integers(0, 4))
    ndims = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    dtypes = draw(st.lists(st.sampled_from(["float32", "int8", "bfloat16", "complex128", "bool"]),
                           min_size=1, max_size=3, unique=True))

    def column(values, damaged=_SOME_INTEGERS):
        last_damaged = st.builds(lambda value: [*values[:-1], value], _EDGES) if values else damaged
        return draw(st.one_of(st.just(values), st.just(values), st.just(values), last_damaged, last_damaged, damaged,
                              st.sampled_from([None, 0, {}])))

    sizes = st.one_of(st.integers(0, 9), st.sampled_from([2**20, 2**31, 2**40, 2**62, 2**63 - 1]))
    dims = column(draw(st.lists(sizes, min_size=sum(ndims), max_size=sum(ndims))),
                  st.lists(_INTEGER, min_size=sum(ndims), max_size=sum(ndims)))
    keys = draw(st.lists(st.sampled_from(["a", "b/w", "c", "d/e/f"]), min_size=count, max_size=count, unique=True))
    raw = {
        "keys": column(keys, st.sampled_from([[*keys, *keys[:1]], ["x/../y", *keys][:count], ["", *keys][:count], [3]])),
        "dtypes": column(dtypes, st.sampled_from([[*dtypes, "nope"], ["nope", *dtypes], [3, *dtypes], dtypes * 2])),
        "dtype": column(draw(st.lists(st.integers(0, len(dtypes) - 1), min_size=count, max_size=count))),
        "ndim": column(ndims),
        "shape": dims,
        "crc32": column(draw(st.lists(st.integers(0, 2**32 - 1), min_size=count, max_size=count))),
    }
    if draw(st.booleans()):
        raw["blake3"] = draw(st.sampled_from(["ab" * 32 * count, "AB" * 32 * count, 3]))
    return raw


@SETTINGS
@given(_columns(), st.sampled_from([2, 3]))
def test_columns_read_alike_as_lists_and_as_arrays(raw, version):
    """A manifest's columns checked as Python lists (a few tensors) and as numpy arrays (many)
    read the same table, or refuse with the same error, words and key alike."""
    outcomes = []
    for few_rows in (1 << 30, -1):
        with patch.object(_tensortable, "FEW_ROWS", few_rows):
            try:
                table = _tensortable.parse_columns(raw, manifest._itemsize_or_none, version)
            except errors.FormatError as exc:
                outcomes.append(("refused", type(exc), str(exc), exc.key))
            else:
                outcomes.append(("read", list(table), table.rows(), [table[key] for key in table]))
    assert outcomes[0] == outcomes[1]


#: JSON values at the edges of what orjson and the stdlib read alike: integers past 64 bits,
#: floats written otherwise than orjson writes them, escapes, a lone surrogate, NaN
_JSON_LEAVES = st.sampled_from(["0", "-0", "7", "1.0", "1e2", "0.1", "18446744073709551615", "18446744073709551616",
                                "-9223372036854775809", '"a"', '"\\u00e9"', '"é"', '"\\ud800"', '"\\/"', '"\\n"',
                                '"\\u001f"', "true", "null", "NaN", "-Infinity", "[1,2"])


def _json_object(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    member = st.tuples(st.sampled_from(["a", "b", "a.b", "é"]), children)  # "a" twice now and then
    return st.builds(lambda members, gap: "{" + f",{gap}".join(f'"{name}":{gap}{value}' for name, value in members) + "}",
                     st.lists(member, max_size=3), st.sampled_from(["", "", " "]))


_JSON_TEXT = st.recursive(_JSON_LEAVES, lambda children: st.one_of(
    _json_object(children), st.builds(lambda items: "[" + ",".join(items) + "]", st.lists(children, max_size=3))),
    max_leaves=8)


@SETTINGS
@given(_JSON_TEXT, st.sampled_from(["", "    ", " \n"]), st.booleans(), st.sampled_from([0, 3, 300]))
def test_json_reads_alike_as_written_and_otherwise(text, padding, as_bytes, depth):
    """JSON from a file reads the same whether orjson's parse is taken (text it writes back
    unchanged) or the stdlib's with its hook: the same document, value types alike, or the same
    refusal (a name twice, NaN, a lone surrogate, nesting past what ``repr`` can show)."""
    text = "[" * depth + text + "]" * depth + padding
    data = text.encode("utf-8", "surrogatepass") if as_bytes else text
    outcomes = []
    for fast in (True, False):
        with patch.object(_jsontext, "_canonical", _jsontext._canonical if fast else lambda _: _jsontext._NOT_CANONICAL):
            try:
                document = _jsontext.loads(data, what="header", min_bytes=1)
            except errors.WeightStoreError as exc:
                outcomes.append(("refused", type(exc), str(exc)))
            except RecursionError:  # the stdlib's parse of 300 levels, which only the rule reaches
                outcomes.append(("refused", RecursionError, ""))
            else:
                outcomes.append(("read", repr(document)))
    assert outcomes[0] == outcomes[1]


_ST_ITEMSIZE = {"F32": 4, "U8": 1, "I16": 2, "BF16": 2}


@st.composite
def _st_header(draw) -> tuple[dict, int]:
    """Header entries and a data buffer's size: mostly entries laid end to end with the offsets
    their dtype and shape need, now and then one that leaves a gap or overlaps, a zero
    dimension, a field hostile or missing, a buffer longer or shorter than the entries."""
    document: dict[str, object] = {}
    cursor = 0
    for name in draw(st.lists(st.sampled_from(["a", "b", "c.d"]), unique=True, max_size=3)):
        code = draw(st.sampled_from([*_ST_ITEMSIZE, *_ST_ITEMSIZE, "F4", "XX", 3]))
        shape = draw(st.lists(st.integers(1, 3), max_size=2) | st.lists(st.integers(0, 2), max_size=2) | st.just([0, 2**62]))
        begin = max(0, cursor + draw(st.sampled_from([0, 0, 0, 0, 2, -2])))
        cursor = begin + math.prod(shape) * _ST_ITEMSIZE.get(code, 4)  # type: ignore[call-overload]
        entry = {"dtype": code, "shape": shape, "data_offsets": [begin, cursor]}
        field = draw(st.sampled_from(["", "", "", "", "", "", "", "", "", "dtype", "shape", "data_offsets", "gone", "whole"]))
        if field == "gone":
            del entry[draw(st.sampled_from(sorted(entry)))]
        elif field == "whole":
            entry = draw(st.sampled_from([None, [], "F32"]))  # type: ignore[assignment]
        elif field:
            entry[field] = draw(st.sampled_from([None, "2", [[2]], [-1], [True], [2.0], [2**64], [0], [0, 4, 8], [-4, 0]]))
        document[name] = entry
    return document, max(0, cursor + draw(st.sampled_from([0, 0, 0, 4, -2])))


@SETTINGS
@given(_st_header())
def test_safetensors_headers_read_alike_column_wise_and_entry_by_entry(header):
    """``safetensors._plain_tensors`` either hands a header's entries over (``None``) or reads
    exactly the tensors ``_check_tensors``'s loop reads; whatever the loop refuses, it hands over."""
    document, data_size = header
    reader = safetensors.SafetensorsReader.__new__(safetensors.SafetensorsReader)
    reader.name, reader._data_start = "w.safetensors", 0
    reader._source = type("Sized", (), {"size": data_size})()
    fast = safetensors._plain_tensors(document, data_size)
    with patch.object(safetensors, "_plain_tensors", lambda *_: None):
        try:
            slow = reader._check_tensors(document)
        except errors.WeightStoreError:
            assert fast is None
            return
    assert fast is None or fast == slow and fast.made(list(slow)[::-1]) == list(slow.values())[::-1]


@SETTINGS
@given(st.lists(st.lists(st.sampled_from([*_PIECES.elements, "a.b", ".", "..", "a."]), max_size=4).map("".join),
                min_size=1, max_size=4))
def test_torch_names_become_keys_alike_at_once_and_one_by_one(names):
    """``keys_of_torch_names`` turns a file's torch names into exactly the keys
    ``key_of_torch_name`` makes of each, or refuses with its words for the first it refuses."""
    def outcome(turn):
        try:
            return turn()
        except errors.InvalidKeyError as exc:
            return ("refused", str(exc))

    assert outcome(lambda: keys_of_torch_names(names)) == outcome(lambda: [key_of_torch_name(name) for name in names])
