"""The manifest's tensors as columns: one list per field, not one JSON object per tensor.

A file of 50,000 small tensors is the case this layout is for. As one object per tensor, its
manifest cost 300,000 Python objects to parse and as many checks, more than reading the
tensors themselves; as columns (version 2 of the manifest) it is a few lists that orjson reads
in milliseconds and numpy checks whole. A :class:`TensorInfo` is made only for a key asked
about; readers of many tensors take whole rows (:meth:`TensorTable.rows`) instead.

The JSON form, inside the manifest's ``"tensors"``::

    {"keys": ["dense/kernel", "dense/bias"], "dtypes": ["float32"], "dtype": [0, 0],
     "ndim": [2, 1], "shape": [3, 4, 4], "crc32": [2914140146, 1028911024],
     "location": {...}, "codec": {...}}

``dtypes`` names each logical dtype once; ``dtype`` indexes it per tensor; ``shape`` is every
tensor's dimensions end to end, ``ndim`` says how many are each tensor's. ``location`` and
``codec`` map only the keys that have one (HDF5 reserved datasets, ``compress="shuffle"``).

Version 3 adds ``"blake3"``: one string, each tensor's BLAKE3 digest of its stored bytes (32
bytes, 64 hex digits) end to end in row order. CRC-32 finds damage; only the digest may
decide that two tensors hold the same bytes (hot reload's skip, ``ws diff``), since a CRC-32
collision takes four chosen bytes to forge. The column is optional: a table without it (every
version 2 file) has no digests, and whoever compares its tensors compares their bytes.
"""

from __future__ import annotations

import array
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import orjson

from weightstore.core.keys import validate_keys
from weightstore.core.limits import MAX_ARRAY_BYTES, MAX_DTYPES, MAX_NDIM
from weightstore.errors import FormatError, InvalidKeyError, short_repr

CHECKSUM_ALGORITHM = "crc32"
CHECKSUM_PREFIX = CHECKSUM_ALGORITHM + ":"
COLUMNS = ("keys", "dtypes", "dtype", "ndim", "shape", "crc32")
SPARSE_COLUMNS = ("location", "codec")
DIGEST_ALGORITHM = "blake3"
DIGEST_PREFIX = DIGEST_ALGORITHM + ":"
#: hex digits of one tensor's digest in the ``blake3`` column
DIGEST_HEX = 64
#: columns a manifest of this version may add to :data:`COLUMNS` (and the version that added them)
OPTIONAL_COLUMNS = {DIGEST_ALGORITHM: 3}
_HEX_DIGITS = b"0123456789abcdef"
#: below this, a float product of dimensions is exact enough to prove a size in bounds
_SURELY_IN_BOUNDS = float(1 << 52)
#: up to this many tensors, a manifest's integer columns are checked as the Python lists JSON
#: gave: numpy's fixed cost per call (some 30 calls, 0.2 ms) is more than Python's loops over
#: a few thousand values cost; above it numpy's whole-column checks win
FEW_ROWS = 2048
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_U32_MAX = 0xFFFFFFFF
#: the array type code of 32-bit unsigned integers ("I" on every platform CPython supports)
_U32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)
#: "no checksum" in the CRC column (version 1 manifests allowed null)
NO_CRC = -1


class TensorInfo(NamedTuple):
    """One tensor as the index describes it; reading it costs nothing."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str | None = None
    #: ``blake3:`` and the hex digest of the stored bytes; None in files written before version 3
    digest: str | None = None


#: a column of integers: the list JSON gave, for a few tensors, or an int64 array (see :data:`FEW_ROWS`)
Column = list[int] | np.ndarray


def _as_list(column: Column) -> list[int]:
    return column if type(column) is list else column.tolist()  # type: ignore[union-attr]


class TensorTable(Mapping[str, TensorInfo]):
    """Key -> :class:`TensorInfo`, in the file's order, held as columns; checked when built
    (:func:`parse_columns`), so nothing read from it later can be out of range."""

    def __init__(self, keys: list[str], dtype_names: list[str], dtype_codes: Column, ndims: Column,
                 dims: Column, nbytes: Column | None, crcs: Column, digests: str | None = None,
                 itemsizes: list[int] | None = None):
        """``nbytes``: each tensor's bytes; or None, and ``itemsizes`` each dtype's item size,
        for a table whose listing should not pay for them (they are made on first use)."""
        self._keys = keys
        self._digests = digests
        self._dtype_names = dtype_names
        self._dtype_codes = dtype_codes
        self._ndims = ndims
        self._dims = dims
        self._nbytes = nbytes
        self._itemsizes = itemsizes
        self._crcs = crcs
        self._rows: tuple[list[str], list[tuple[int, ...]], list[int], list[int]] | None = None

    @classmethod
    def from_infos(cls, infos: Sequence[TensorInfo]) -> TensorTable:
        """A table of entries already checked one by one (version 1 manifests)."""
        names = list(dict.fromkeys(info.dtype for info in infos))
        code = {name: i for i, name in enumerate(names)}
        return cls(
            [info.key for info in infos], names,
            np.fromiter((code[info.dtype] for info in infos), np.int64, len(infos)),
            np.fromiter((len(info.shape) for info in infos), np.int64, len(infos)),
            np.fromiter(itertools.chain.from_iterable(info.shape for info in infos), np.int64),
            np.fromiter((info.nbytes for info in infos), np.int64, len(infos)),
            np.fromiter((NO_CRC if info.checksum is None else int(info.checksum[len(CHECKSUM_PREFIX):], 16)
                         for info in infos), np.int64, len(infos)),
        )

    # -- the mapping ---------------------------------------------------------------------
    @functools.cached_property
    def _position(self) -> dict[str, int]:
        """Key -> row, made on first use: listing the keys does not need it."""
        return dict(zip(self._keys, range(len(self._keys)), strict=True))

    def __getitem__(self, key: str) -> TensorInfo:
        i = self._position[key]
        names, shapes, nbytes, crcs = self.rows()
        crc = crcs[i]
        digest = None if self._digests is None else DIGEST_PREFIX + self._digests[DIGEST_HEX * i : DIGEST_HEX * (i + 1)]
        return TensorInfo(key, names[i], shapes[i], nbytes[i], None if crc == NO_CRC else f"{CHECKSUM_PREFIX}{crc:08x}",
                          digest)

    def __contains__(self, key: object) -> bool:
        return key in self._position

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def has_digests(self) -> bool:
        """Whether each tensor's content digest is recorded (files before version 3 record none)."""
        return self._digests is not None

    def key_list(self) -> list[str]:
        """The keys in the file's order (a new list)."""
        return list(self._keys)

    # -- columns, for readers of many tensors ------------------------------------------------
    @property
    def row_index(self) -> Mapping[str, int]:
        """Key -> row."""
        return self._position

    def positions(self, keys: Sequence[str]) -> np.ndarray:
        """Each key's row; every key must be in the table."""
        return np.fromiter(map(self._position.__getitem__, keys), np.int64, len(keys))

    def rows(self) -> tuple[list[str], list[tuple[int, ...]], list[int], list[int]]:
        """``(dtype names, shapes, nbytes, CRCs)`` as lists by row, made on first use: indexing a
        list is the cheapest way to a Python value, and a shape must be a tuple anyway."""
        if self._rows is None:
            ndims = self._ndims
            ends = list(itertools.accumulate(ndims)) if type(ndims) is list else np.cumsum(ndims).tolist()
            dims = _as_list(self._dims)
            shapes = list(map(tuple, map(dims.__getitem__, map(slice, [0, *ends[:-1]], ends))))
            codes = _as_list(self._dtype_codes)
            if self._nbytes is None:
                itemsizes: list[int] = self._itemsizes  # type: ignore[assignment]  # given with nbytes=None
                nbytes = list(map(operator.mul, map(math.prod, shapes), map(itemsizes.__getitem__, codes)))
            else:
                nbytes = _as_list(self._nbytes)
            self._rows = (list(map(self._dtype_names.__getitem__, codes)), shapes, nbytes, _as_list(self._crcs))
        return self._rows


#: a tensor as a writer learns it: key, logical dtype name, shape, CRC-32 of its stored bytes
TensorRow = tuple[str, str, tuple[int, ...], int]


def columns_text(tensors: Sequence[TensorRow], digests: Sequence[bytes] | None = None) -> str:
    """The JSON of the columns for ``tensors`` (their keys already valid), with each one's
    content digest (raw, in the same order) when given."""
    keys, dtypes, shapes, crcs = (list(map(operator.itemgetter(field), tensors)) for field in range(4))
    names = list(dict.fromkeys(dtypes))
    code = {name: i for i, name in enumerate(names)}
    columns: dict[str, Any] = {
        "keys": keys, "dtypes": names, "dtype": list(map(code.__getitem__, dtypes)),
        "ndim": list(map(len, shapes)), "shape": list(itertools.chain.from_iterable(shapes)),
        "crc32": crcs,
    }
    if digests is not None:
        columns[DIGEST_ALGORITHM] = b"".join(digests).hex()
    return orjson.dumps(columns).decode("utf-8")


def parse_columns(raw: dict[str, Any], itemsize_of: Callable[[object], int | None],
                  version: int = 3) -> TensorTable:
    """Check the columns of an untrusted manifest of ``version`` whole: types, lengths and
    ranges, the keys' rules, and that every shape fits an array; ``itemsize_of`` gives a dtype
    name's item size, or None for a name that is no dtype. Errors name no file: the caller's
    :func:`~weightstore.errors.naming` attaches it.

    Up to :data:`FEW_ROWS` tensors the integer columns are checked as Python lists, above it as
    numpy arrays (see there); both refuse the same manifests with the same words, which the
    differential test ``tests/test_fast_paths.py::test_columns_read_alike_as_lists_and_as_arrays``
    binds."""
    if not _REQUIRED <= raw.keys() <= _allowed_columns(version):
        optional = [name for name, since in OPTIONAL_COLUMNS.items() if version >= since]
        raise FormatError(f"manifest tensor columns are {sorted(raw)}, not {list(COLUMNS)} "
                          f"(and optionally {[*SPARSE_COLUMNS, *optional]})")
    keys = raw["keys"]
    if type(keys) is not list:
        raise FormatError("manifest 'keys' is not a list of strings")
    try:
        validate_keys(keys)  # which refuses a key that is no str too: asked which, only then
    except InvalidKeyError as exc:
        if not _all_text(keys):
            raise FormatError("manifest 'keys' is not a list of strings") from None
        raise FormatError(f"manifest has an {exc.message}", key=exc.key) from None
    count = len(keys)
    if len(set(keys)) != count:
        seen: set[str] = set()
        twice = next(key for key in keys if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise FormatError(f"manifest lists tensor {twice!r} twice")
    names = raw["dtypes"]
    texts = [name for name in names if type(name) is str] if type(names) is list else []  # any other: no dtype, below
    if type(names) is not list or len(names) > MAX_DTYPES or len(set(texts)) != len(texts):
        raise FormatError("manifest 'dtypes' is not a list of distinct dtype names")
    few = count <= FEW_ROWS
    codes, _ = _int_column(raw, "dtype", count, len(names) - 1, few, repeats=True)
    itemsizes = []
    for code, name in enumerate(names):
        itemsize = itemsize_of(name)
        if itemsize is None:
            user = next((row for row, used in enumerate(codes) if used == code), None)
            if user is not None:  # the tensor named as a version 1 manifest's entry names it
                raise FormatError(f"unknown dtype {short_repr(name)}", key=keys[user])
            raise FormatError(f"manifest: unknown dtype {short_repr(name)}")
        itemsizes.append(itemsize)
    ndims, most_dims = _int_column(raw, "ndim", count, MAX_NDIM, few, repeats=True)
    dims, largest = _int_column(raw, "shape", sum(ndims) if few else int(ndims.sum()), MAX_ARRAY_BYTES, few)
    crcs, _ = _int_column(raw, "crc32", count, _U32_MAX, few)
    if few:  # each tensor's bytes are made on first use (listing keys needs none)
        nbytes = None
        # the largest dimension to the most dimensions, times the largest item, bounds every
        # tensor's bytes: within the bound no shape needs a look of its own
        if max(largest, 1) ** most_dims * max(itemsizes, default=1) > MAX_ARRAY_BYTES:
            _check_few_sizes(keys, ndims, dims, list(map(itemsizes.__getitem__, codes)))
    else:
        nbytes = _sizes(keys, ndims, dims, np.asarray(itemsizes, dtype=np.int64)[codes])
    return TensorTable(keys, names, codes, ndims, dims, nbytes, crcs, _digest_column(raw, count), itemsizes)


_REQUIRED = frozenset(COLUMNS)


@functools.lru_cache(maxsize=8)
def _allowed_columns(version: int) -> frozenset[str]:
    """The columns a manifest of ``version`` may hold (made once per version, not per open)."""
    return frozenset((*COLUMNS, *SPARSE_COLUMNS, *(name for name, since in OPTIONAL_COLUMNS.items() if version >= since)))


def _all_text(values: list[Any]) -> bool:
    """Whether every value is a str (JSON makes no subclass of one): joining them tells, at a
    fifth of the cost of testing each one's type."""
    try:
        "".join(values)
    except TypeError:
        return False
    return True


def _digest_column(raw: dict[str, Any], count: int) -> str | None:
    """The ``blake3`` column: ``count`` digests as lowercase hex, end to end; None when absent."""
    column = raw.get(DIGEST_ALGORITHM)
    if column is None:
        return None
    if type(column) is not str or len(column) != DIGEST_HEX * count or not _is_lower_hex(column):
        raise FormatError(f"manifest column {DIGEST_ALGORITHM!r} is not {count} digests of {DIGEST_HEX} "
                          "lowercase hex digits end to end")
    return column


def _is_lower_hex(text: str) -> bool:
    """Deleting the hex digits in C leaves nothing: 15x faster than a set's ``issuperset`` over
    the 3.2 million characters of 50,000 digests."""
    return text.isascii() and not text.encode("ascii").translate(None, _HEX_DIGITS)


def fits_an_array(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether numpy can make an array of ``shape`` (it counts a zero dimension as one)."""
    return math.prod(max(size, 1) for size in shape) * itemsize <= MAX_ARRAY_BYTES


def _int_column(raw: dict[str, Any], field: str, count: int, most: int, few: bool,
                repeats: bool = False) -> tuple[Any, int]:
    """A list of ``count`` integers from 0 to ``most`` (``true`` is no integer here): the list
    itself when ``few``, else as int64; either way one past 64 bits is refused, as numpy
    refuses to hold it. With the largest (0 for none), which the caller's bounds reuse.
    ``repeats``: a valid column holds only a few distinct values (a cheaper check when ``few``)."""
    column = raw[field]
    if type(column) is not list or len(column) != count:
        raise FormatError(f"manifest column {field!r} is not a list of {count} integers")
    if operator.countOf(map(type, column), int) != count:  # no set: half the cost
        raise FormatError(f"manifest column {field!r} holds something other than integers")
    if few:
        values: Any = column
        if most == _U32_MAX and _all_u32(column):  # the CRCs: no caller needs their largest
            return values, most
        # a valid column of dtype codes or ndims holds a few distinct values: min and max of
        # their set cost half of min and max over the list (of 2,048 distinct dims, twice)
        distinct = set(column) if repeats else column
        low, high = min(distinct, default=0), max(distinct, default=0)
        if low < _INT64_MIN or high > _INT64_MAX:
            raise FormatError(f"manifest column {field!r} holds an integer past 64 bits")
    else:
        try:
            values = np.array(column, dtype=np.int64)
        except OverflowError:
            raise FormatError(f"manifest column {field!r} holds an integer past 64 bits") from None
        low, high = (values.min(), values.max()) if column else (0, 0)
    if column and (low < 0 or high > most):
        bad = next(i for i, value in enumerate(column) if not 0 <= value <= most)
        raise FormatError(f"manifest column {field!r} holds {column[bad]} (entry {bad}), "
                          f"outside 0..{most}")
    return values, high


def _all_u32(column: list[int]) -> bool:
    """Whether every value of a list of integers lies in 0..2**32-1: one conversion in C
    (``array`` refuses any outside), for the CRC column, whose values repeat too seldom for a
    set to pay (:func:`_int_column`)."""
    try:
        array.array(_U32_CODE, column)
    except OverflowError:
        return False
    return True


def _check_few_sizes(keys: list[str], ndims: list[int], dims: list[int], itemsizes: list[int]) -> None:
    """:func:`_sizes`'s refusal for a few tensors, on lists: exact Python integers throughout."""
    ends = list(itertools.accumulate(ndims))
    shapes = list(map(dims.__getitem__, map(slice, [0, *ends[:-1]], ends)))
    nbytes = list(map(operator.mul, map(math.prod, shapes), itemsizes))
    # numpy counts a zero dimension as one (:func:`fits_an_array`); without one, the bytes are the bound
    bounded = nbytes if 0 not in dims else [
        math.prod(max(size, 1) for size in shape) * itemsize for shape, itemsize in zip(shapes, itemsizes, strict=True)]
    if max(bounded, default=0) > MAX_ARRAY_BYTES:
        i = next(row for row, size in enumerate(bounded) if size > MAX_ARRAY_BYTES)
        raise FormatError(f"tensor {keys[i]!r} has a shape {tuple(shapes[i])} too large for any array")


def _sizes(keys: list[str], ndims: np.ndarray, dims: np.ndarray, itemsizes: np.ndarray) -> np.ndarray:
    """Each tensor's bytes, refusing a shape no array can have: proved in floats for the usual
    sizes, exactly (Python integers) for any near the bound."""
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    # a leading 1 per tensor makes every segment non-empty (reduceat misreads empty ones)
    starts = np.concatenate(([0], np.cumsum(ndims)[:-1]))
    padded_starts = starts + np.arange(len(keys))
    padded = np.ones(len(dims) + len(keys), dtype=np.int64)  # np.insert(dims, starts, 1), at a third of its cost
    is_dim = np.ones(len(padded), dtype=bool)
    is_dim[padded_starts] = False
    padded[is_dim] = dims
    estimate = np.multiply.reduceat(np.maximum(padded, 1).astype(np.float64), padded_starts) * itemsizes
    for i in np.flatnonzero(estimate >= _SURELY_IN_BOUNDS).tolist():
        shape = tuple(dims[starts[i] : starts[i] + ndims[i]].tolist())
        if not fits_an_array(shape, int(itemsizes[i])):
            raise FormatError(f"tensor {keys[i]!r} has a shape {shape} too large for any array")
    return np.multiply.reduceat(padded, padded_starts) * itemsizes
