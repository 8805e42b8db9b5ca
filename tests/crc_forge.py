"""A CRC-32 collision, made to order: what shows that a checksum cannot decide "unchanged"."""

from __future__ import annotations

import zlib

import numpy as np


def forge_crc32_collision(original: np.ndarray, changed_first: float) -> np.ndarray:
    """A float32 array unlike ``original`` (its first element ``changed_first``, its last four
    bytes computed) whose CRC-32 equals ``original``'s.

    CRC-32 is affine over GF(2): for messages of one length, the CRC of the last four bytes'
    changes is a linear map of 32 bits onto 32 bits (invertible), so solving it for the CRC
    wanted is Gaussian elimination.
    """
    forged = original.astype(np.float32).copy()
    forged.flat[0] = changed_first
    raw = bytearray(forged.tobytes())
    target = zlib.crc32(original.tobytes())
    raw[-4:] = b"\0\0\0\0"
    base = zlib.crc32(bytes(raw))
    columns = []
    for bit in range(32):
        probe = bytearray(raw)
        probe[-4 + bit // 8] ^= 1 << (bit % 8)
        columns.append(zlib.crc32(bytes(probe)) ^ base)
    # an XOR basis of the columns, each by its highest bit, with the bits of x that make it
    basis: dict[int, tuple[int, int]] = {}
    for bit, column in enumerate(columns):
        value, combo = column, 1 << bit
        for high in range(31, -1, -1):
            if value >> high & 1:
                if high not in basis:
                    basis[high] = (value, combo)
                    break
                value, combo = value ^ basis[high][0], combo ^ basis[high][1]
    want, chosen = target ^ base, 0
    for high in range(31, -1, -1):
        if want >> high & 1:
            want, chosen = want ^ basis[high][0], chosen ^ basis[high][1]
    assert want == 0
    for bit in range(32):
        if chosen >> bit & 1:
            raw[-4 + bit // 8] ^= 1 << (bit % 8)
    result = np.frombuffer(bytes(raw), np.float32).reshape(original.shape).copy()
    assert zlib.crc32(result.tobytes()) == target and result.tobytes() != original.tobytes()
    return result
