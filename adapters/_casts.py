"""Which dtypes go into which: lossless widening (``float16`` into ``float32``), and with
``cast=True`` the casts that keep every value (checked per array: range, NaN and inf, -0).

ml_dtypes (whose ``iinfo``/``finfo`` answer for numpy's types too) is imported by the functions
that use it: importing it costs about a CPU-second, and the CLI imports this module for
:func:`describe` alone (see :data:`weightstore.core.manifest.ML_DTYPES`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from weightstore.core.manifest import ML_DTYPES


def widens(source: np.dtype, target: np.dtype) -> bool:
    """Whether every value of ``source`` is exactly representable in ``target``."""
    source, target = np.dtype(source), np.dtype(target)
    return source == target or _widens(source, target)


@functools.lru_cache(maxsize=1024)  # asked once per tensor of a plan; a model has a handful of dtype pairs
def _widens(source: np.dtype, target: np.dtype) -> bool:
    try:
        if not np.can_cast(source, target, "safe"):
            return False
    except TypeError:
        return False
    integers = _integer_bits(source)
    if integers is not None:
        return _holds_integers(target, *integers)
    return not _loses_negative_zero(source, target)


def _loses_negative_zero(source: np.dtype, target: np.dtype) -> bool:
    """Whether ``source`` has a negative zero that ``target`` makes positive (the ``fnuz``
    float8 types have one zero, so float4_e2m1fn's -0 comes out +0 though numpy calls it safe)."""
    if _complex_part(source) is not None:
        return False  # a safe complex cast keeps both parts' types
    target = _complex_part(target) or target  # a real value becomes the real part
    with np.errstate(all="ignore"):
        negative_zero = np.array(-0.0).astype(source)
        return bool(np.signbit(negative_zero)) and not np.signbit(negative_zero.astype(target))


def _integer_bits(dtype: np.dtype) -> tuple[int, bool] | None:
    """Magnitude bits and signedness of a bool or integer dtype (numpy's or ml_dtypes', such as
    int4), ``None`` for any other: numpy calls every integer -> float cast safe."""
    if dtype.kind == "b":
        return 1, False
    import ml_dtypes

    try:
        info = ml_dtypes.iinfo(dtype)
    except ValueError:
        return None
    signed = info.min < 0
    return info.bits - signed, signed


def _holds_integers(target: np.dtype, bits: int, signed: bool) -> bool:
    """Whether ``target`` holds every integer of ``bits`` magnitude bits: a float needs that many
    significand bits (int64 does not fit float64, nor int8 float8_e4m3fn), the range for the
    largest, a sign for negatives and a zero (float8_e8m0fnu has neither). ml_dtypes' floats
    are numpy kind ``V`` (some ``f``), so ``ml_dtypes.finfo`` tells what a float is."""
    import ml_dtypes

    try:
        info = ml_dtypes.finfo(target)
    except ValueError:
        return True  # an integer: np.can_cast judged its range
    return (bits <= info.nmant + 1 and bits < info.maxexp and (info.min < 0 or not signed)
            and target.type(0) == 0)


def castable(source: np.dtype, target: np.dtype) -> bool:
    try:
        return np.can_cast(source, target, "unsafe") and source.kind in "biufcV" and target.kind in "biufcV"
    except TypeError:
        return False


def out_of_range(array: np.ndarray, dtype: np.dtype) -> str:
    """What of ``array`` a cast to ``dtype`` cannot hold ("" if nothing).

    ``cast=True`` accepts rounding (float64 to float32, float to int), but numpy's cast turns
    a value beyond the target's range into inf, or wraps an integer around, without a word: the
    variable would silently hold other numbers than the file. A complex value may lose its
    imaginary part only where that is zero. A bool takes 0 and 1 alone: numpy's cast makes any
    other number True, NaN and 0.3 included.
    """
    target = np.dtype(dtype)
    if array.size == 0 or widens(array.dtype, target):
        return ""
    if _complex_part(array.dtype) is not None:
        array = np.ascontiguousarray(array, np.complex128)  # ml_dtypes' complex32, bcomplex32 too; viewed below
        part = _complex_part(target)
        if part is None:
            return (f"holds complex values with an imaginary part, which {target.name} cannot hold"
                    if np.any(array.imag) else out_of_range(array.real, target))
        return out_of_range(array.view(np.float64), part)  # both parts
    if (real_part := _complex_part(target)) is not None:  # a real value becomes the real part
        return out_of_range(array, real_part)
    if array.dtype.kind == "V":  # an ml_dtypes type (bfloat16, float8, int4), reduced as a numpy one
        array = array.astype(np.int64 if _is_integer(array.dtype) else np.float64)
    if target.kind == "b":
        other = array[(array != 0) & (array != 1)]
        return f"holds {other.flat[0].item():g}, which bool cannot hold (only 0 and 1)" if other.size else ""
    integer = _is_integer(target)
    smallest, largest = np.min(array).item(), np.max(array).item()  # NaN, if any, comes out as NaN
    if array.dtype.kind == "f" and not (math.isfinite(smallest) and math.isfinite(largest)):
        if integer:
            return f"holds {'NaN' if np.isnan(array).any() else 'inf'}, which {target.name} cannot hold"
        special = _special_lost(array, target)
        if special:
            return f"holds {special}, which {target.name} cannot hold (a cast would not keep it)"
        finite = np.isfinite(array)
        if not finite.any():
            return ""
        smallest = np.min(array, where=finite, initial=np.inf).item()
        largest = np.max(array, where=finite, initial=-np.inf).item()
    import ml_dtypes

    limits = ml_dtypes.iinfo(target) if integer else None  # numpy's types too
    kept = None if integer else _largest_rounded_in(target)
    for extreme in (smallest, largest):
        if limits is not None:  # a cast to an integer truncates toward zero
            fits = int(limits.min) <= math.trunc(extreme) <= int(limits.max)
        else:  # rounds to nearest: past the largest value by half a step it becomes inf (float8: NaN), or
            # the largest value itself in a type without inf or NaN (float4_e2m1fn: 1e10 becomes 6)
            with np.errstate(over="ignore", invalid="ignore"):
                cast = np.array(extreme, array.dtype).astype(target).astype(np.float64)
            fits = bool(np.isfinite(cast)) and abs(extreme) <= (kept or 0.0)
        if not fits:
            shown = f"{extreme:g}" if isinstance(extreme, float) else str(extreme)
            return f"holds {shown}, beyond {target.name}'s range (cast=True converts values as numpy does, it does not clip them)"
    return ""


@functools.lru_cache(maxsize=256)
def _largest_rounded_in(target: np.dtype) -> float:
    """The largest magnitude a cast to the float ``target`` rounds rather than overflows: its
    largest value and half the step below it."""
    import ml_dtypes

    largest = np.array(ml_dtypes.finfo(target).max, target)
    below = largest.view(f"u{target.itemsize}") - 1  # the next smaller positive float's bits
    step = float(largest.astype(np.float64)) - float(below.view(target).astype(np.float64))
    return float(largest.astype(np.float64)) + step / 2


def _special_lost(array: np.ndarray, target: np.dtype) -> str:
    """The first of NaN, inf and -inf that ``array`` holds and a cast to the float ``target``
    does not keep ("" if none): float8_e4m3fn has no inf (it becomes NaN), float4_e2m1fn
    neither NaN nor inf, float8_e8m0fnu no sign."""
    for value, present in ((math.nan, np.isnan(array).any()), (math.inf, np.isposinf(array).any()),
                           (-math.inf, np.isneginf(array).any())):
        if present:
            with np.errstate(all="ignore"):
                cast = float(np.array(value).astype(target).astype(np.float64))
            if not (cast == value or (math.isnan(value) and math.isnan(cast))):
                return str(value)
    return ""


def _complex_part(dtype: np.dtype) -> np.dtype | None:
    """The dtype of each part of a complex ``dtype`` (numpy's, or ml_dtypes' ``complex32`` of
    float16 parts and ``bcomplex32`` of bfloat16 ones); ``None`` for any other."""
    if dtype.name == "bcomplex32":  # an array of it exists: ml_dtypes is imported
        return ML_DTYPES["bfloat16"]
    if dtype.kind == "c":
        return np.dtype(f"f{dtype.itemsize // 2}")
    return None


def _is_integer(dtype: np.dtype) -> bool:
    return dtype.kind in "iu" or (dtype.kind == "V" and not dtype.name.startswith(("float", "bfloat", "bcomplex")))


def describe(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"
