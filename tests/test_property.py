"""Property-based: any dictionary of valid keys and arrays round-trips, in both formats."""

from __future__ import annotations

import tempfile
from pathlib import Path

import hypothesis.extra.numpy as hnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import weightstore as ws
from weightstore.adapters._casts import out_of_range
from weightstore.core import keys as K

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- keys -----------------------------------------------------------------------------------------

#: few, short segment names so that one key is often the scope of another (``w`` and ``w/Adagrad``)
_TREE_SEGMENTS = st.sampled_from(["w", "Adagrad", "b", "model_1", "model_10", "x.y", "kérnel", "a b", "0"])
_FREE_SEGMENTS = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="/\\"), min_size=1, max_size=8,
)
_SEGMENT = st.one_of(_TREE_SEGMENTS, _TREE_SEGMENTS, _FREE_SEGMENTS)
KEY = st.lists(_SEGMENT, min_size=1, max_size=4).map("/".join).filter(lambda k: K._key_problem(k) is None)

# -- arrays ---------------------------------------------------------------------------------------

_NUMPY_DTYPES = st.sampled_from([
    "?", "i1", "<i2", ">i2", "<i4", ">i4", "<i8", "u1", "<u2", "<u4", ">u8",
    "<f2", ">f2", "<f4", ">f4", "<f8", ">f8", "<c8", ">c16", "<c16",
]).map(np.dtype)
_SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
_PLAIN = _NUMPY_DTYPES.flatmap(lambda dtype: hnp.arrays(dtype, _SHAPES))
_ML = st.sampled_from([ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
                       ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz]).flatmap(
    lambda kind: hnp.arrays(np.dtype(f"u{np.dtype(kind).itemsize}"), _SHAPES).map(lambda raw: raw.view(kind))
)
_STRIDED = hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=6)).map(lambda a: a.T[::-1])
ARRAY = st.one_of(_PLAIN, _PLAIN, _ML, _STRIDED)

WEIGHTS = st.dictionaries(KEY, ARRAY, max_size=8)
METADATA = st.dictionaries(st.text(max_size=5), st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
), max_size=4)


def _native(array: np.ndarray) -> np.ndarray:
    return array.astype(array.dtype.newbyteorder("=")) if array.dtype.byteorder == ">" else array


def _round_trip(suffix: str, weights, metadata, compress: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"w{suffix}"
        ws.save(path, weights, metadata=metadata, compress=compress)
        loaded = ws.load(path)
        with ws.open(path) as store:
            assert list(store.keys()) == list(weights)
            assert store.metadata == metadata
    assert list(loaded) == list(weights)
    for key, value in weights.items():
        expected = _native(value)
        got = loaded[key]
        assert got.dtype == expected.dtype, key
        assert got.shape == expected.shape, key
        assert got.tobytes() == np.ascontiguousarray(expected).tobytes(), key


@SETTINGS
@given(weights=WEIGHTS, metadata=METADATA, compress=st.booleans())
def test_any_weights_round_trip_npz(weights, metadata, compress):
    _round_trip(".npz", weights, metadata, compress)


@SETTINGS
@given(weights=WEIGHTS, metadata=METADATA, compress=st.booleans())
def test_any_weights_round_trip_h5(weights, metadata, compress):
    _round_trip(".h5", weights, metadata, compress)


@SETTINGS
@given(keys=st.lists(st.lists(_TREE_SEGMENTS, min_size=1, max_size=4).map("/".join), min_size=1, max_size=10, unique=True),
       suffix=st.sampled_from([".npz", ".h5"]))
def test_keys_that_are_scopes_of_others_in_any_order(keys, suffix):
    """Trees of ``w``, ``w/Adagrad``, ``w/Adagrad/b``…, inserted in any order."""
    weights = {key: np.full((2,), i, dtype=np.int32) for i, key in enumerate(keys)}
    _round_trip(suffix, weights, {}, False)


# -- keys and scopes as pure functions ------------------------------------------------------------

@SETTINGS
@given(keys=st.lists(KEY, min_size=1, max_size=12, unique=True), scope=st.lists(_TREE_SEGMENTS, min_size=1, max_size=2).map("/".join))
def test_scope_out_is_the_inverse_of_scope_in(keys, scope):
    weights = {key: i for i, key in enumerate(keys)}
    placed = ws.remap(weights, scope=scope)
    assert list(placed) == [f"{scope}/{k}" for k in keys]
    plan = K.plan_outward(placed, scope=scope)
    assert {new: placed[old] for new, old in plan.items()} == weights


@SETTINGS
@given(keys=st.lists(KEY, min_size=1, max_size=12, unique=True), scope=st.lists(_TREE_SEGMENTS, min_size=1, max_size=2).map("/".join))
def test_scope_matches_whole_segments_only(keys, scope):
    for key in keys:
        expected = key == scope or key.startswith(scope + "/")
        assert K.in_scope(key, scope) == expected
        assert K.matches(key, scope) == expected


_ANY_KEY = st.lists(st.sampled_from([*"ab/.:_0\\\x00\n\x7fé\u0301\u200b", "__weightstore"]), max_size=12).map("".join)


@SETTINGS
@given(st.lists(_ANY_KEY, max_size=6))
def test_bulk_key_check_agrees_with_the_one_key_check(keys):
    """``validate_keys`` (joined-text scans) refuses exactly the lists that hold a key ``validate_key`` refuses."""
    bad = [k for k in keys if K._key_problem(k) is not None]
    if bad:
        with pytest.raises(ws.InvalidKeyError):
            K.validate_keys(keys)
    else:
        assert K.validate_keys(keys) == keys



_NUMERIC = st.sampled_from([np.dtype(name) for name in ("int8", "uint8", "int16", "int32", "int64", "uint64",
                                                      "float16", "float32", "float64")])


@SETTINGS
@given(data=st.data(), source=_NUMERIC, target=_NUMERIC)
def test_cast_range_check_agrees_with_numpy(data, source, target):
    """``out_of_range`` refuses exactly the arrays whose cast leaves the target's range: an
    integer that comes back as another number, a finite float that comes back as inf, or a
    NaN or inf cast to an integer."""
    array = data.draw(hnp.arrays(source, st.integers(1, 6), elements=hnp.from_dtype(source, allow_subnormal=False)))
    with np.errstate(all="ignore"):
        cast = array.astype(target)
    if target.kind == "f":
        changed = np.isfinite(array) & ~np.isfinite(cast)
    elif source.kind == "f":
        changed = ~np.isfinite(array) | (np.trunc(array, where=np.isfinite(array), out=np.zeros_like(array))
                                         != cast.astype(np.float64))
    else:
        changed = cast.astype(object) != array.astype(object)  # exact for every integer pair
    assert bool(out_of_range(array, target)) == bool(np.any(changed)), (array, target)


_F4, _F8, _E8M0, _FNUZ = (np.dtype(t) for t in (ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn,
                                                  ml_dtypes.float8_e8m0fnu, ml_dtypes.float8_e4m3fnuz))


@pytest.mark.parametrize("values, target, refused", [
    ([np.inf, 1.0], _F8, "holds inf, which float8_e4m3fn cannot hold"),  # it has no inf: NaN
    ([-np.inf, 1.0], _FNUZ, "holds -inf"),
    ([np.nan, 1.0], _F4, "holds nan"),  # neither NaN nor inf: it would become 0
    ([1e10, 1.0], _F4, "1e+10, beyond float4_e2m1fn's range"),  # saturates to 6, without inf to go to
    ([7.5, 1.0], _F4, "7.5, beyond"),
    ([-1.0, 1.0], _E8M0, "-1, beyond"),  # no sign
    ([1e30 + 2j, 3], np.dtype(ml_dtypes.complex32), "1e+30, beyond float16's range"),  # its parts are float16
    ([6.9, 1.0], _F4, ""),  # rounds to 6, within half a step of the largest value
    ([np.nan, np.inf, -np.inf, 1.0], np.dtype(ml_dtypes.bfloat16), ""),
    ([1e30, 1.0], np.dtype(ml_dtypes.bcomplex32), ""),  # its parts are bfloat16, of float32's range
])
def test_cast_range_check_of_ml_dtypes_targets(values, target, refused):
    """Narrow floats overflow three ways: to inf, to NaN (no inf: float8_e4m3fn), or to their
    largest value (neither: float4_e2m1fn). Each is a value the cast does not keep."""
    problem = out_of_range(np.array(values), target)
    assert (refused in problem) if refused else problem == "", problem


@pytest.mark.parametrize("kind", [ml_dtypes.bcomplex32, ml_dtypes.complex32])
def test_an_imaginary_part_of_ml_dtypes_complex_is_not_dropped(kind):
    """bcomplex32 (numpy kind V) was taken for an integer and its imaginary part cast away;
    complex32 (kind c) recursed until Python gave up."""
    assert "imaginary part" in out_of_range(np.array([1.5 + 2j, 3], kind), np.dtype(np.float32))
    assert out_of_range(np.array([1.5 + 0j, 3], kind), np.dtype(np.float32)) == ""


def test_a_float_whose_negative_zero_a_target_loses_does_not_widen():
    from weightstore.adapters._casts import widens

    assert widens(_F4, _F8) and not widens(_F4, _FNUZ)  # fnuz types have one zero: -0 comes out +0
    for real in (np.float16, np.float32, ml_dtypes.bfloat16, _F8, _F4):  # the sign goes to the real part
        assert widens(np.dtype(real), np.dtype(np.complex64)) and widens(np.dtype(real), np.dtype(np.complex128))
    assert not widens(np.dtype(np.float64), np.dtype(np.complex64))


def test_a_transposed_complex_value_is_range_checked():
    values = np.full((2, 3), 1e300 + 0j).T  # not contiguous: its parts are not one view away
    assert "1e+300, beyond float32's range" in out_of_range(values, np.dtype(np.complex64))
    assert out_of_range(np.ones((2, 3), np.complex128).T, np.dtype(np.complex64)) == ""


# -- mapping rules ----------------------------------------------------------------------------------

#: rule sides as users type them, ``*/`` endings among them, and odd ones (globs, slashes, empty)
_SCOPE_SIDE = st.lists(_TREE_SEGMENTS, min_size=0, max_size=2).map("/".join)
_ENDING_SIDE = st.lists(_TREE_SEGMENTS, min_size=1, max_size=2).map(lambda parts: "*/" + "/".join(parts))
_ODD_SIDE = st.one_of(st.sampled_from(["*", "*/", "*//w", "*/w/", "w//", "/w", "*/*", "*/w?", "**/w", "*/../w",
                                       "*/.", "x=y"]), _FREE_SEGMENTS)
_RULES = st.lists(st.one_of(st.tuples(_SCOPE_SIDE, _SCOPE_SIDE), st.tuples(_ENDING_SIDE, _ENDING_SIDE),
                            st.tuples(_ENDING_SIDE, st.just("*")),
                            st.tuples(st.one_of(_SCOPE_SIDE, _ENDING_SIDE, _ODD_SIDE),
                                      st.one_of(_SCOPE_SIDE, _ENDING_SIDE, _ODD_SIDE))), max_size=3)
_TREE_KEYS = st.lists(st.lists(_TREE_SEGMENTS, min_size=1, max_size=3).map("/".join), min_size=1, max_size=10,
                      unique=True)


@SETTINGS
@given(keys=_TREE_KEYS, rules=_RULES, as_strings=st.booleans())
def test_mapping_rules_refuse_with_their_errors_and_never_merge_two_keys(keys, rules, as_strings):
    """Any rules, ``*/`` ones among them: parse_mapping and remap raise InvalidKeyError or
    SelectionError or rename; what they rename is valid keys, one per source, and the only key
    left out is a raw one whose name a ``*/END`` rule gives another (the documented EMA read)."""
    mapping = [f"{s}={t}" for s, t in rules] if as_strings else dict(rules)
    weights = {key: index for index, key in enumerate(keys)}
    try:
        parsed = K.parse_mapping(mapping)
        renamed = K.remap(weights, mapping=mapping)
    except (ws.InvalidKeyError, ws.SelectionError) as exc:
        event(f"refused: {type(exc).__name__}")
        return
    event("renamed" if list(renamed) != keys else "unchanged")
    assert K.parse_mapping([f"{s}={t}" for s, t in parsed]) == parsed  # parsing what it parsed changes nothing
    assert len(set(renamed.values())) == len(renamed)  # one source per key: nothing merged
    for new in renamed:
        K.validate_key(new)
    ending_names = {K.map_key(k, parsed) for k in keys if K.ends_by_rule(k, parsed)}
    left_out = set(keys) - {keys[i] for i in renamed.values()}
    assert all(not K.ends_by_rule(k, parsed) and K.map_key(k, parsed) in ending_names for k in left_out), left_out
