"""Write the golden files of the current format version in this folder; commit what it writes.

    .venv/bin/python tests/data/make_golden.py

``tests/test_golden.py`` reads the committed files and checks every value, so later versions
of weightstore keep reading what each version wrote. Files already here are never rewritten:
a new format version adds its own (``golden_v2*`` beside ``golden_v1*``).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import ml_dtypes
import numpy as np

import weightstore as ws
from weightstore.core.manifest import FORMAT_VERSION

HERE = Path(__file__).resolve().parent
METADATA = {"step": 1000, "note": "golden v1 ✓", "nested": {"lr": 0.001, "list": [1, 2.5, None, True]}}


def weights() -> dict[str, np.ndarray]:
    return {
        "model_001/dense/kernel": (np.arange(12, dtype=np.float32) / 8).reshape(3, 4),
        "model_001/dense/bias": np.array([-1.5, 0.0, 2.25], dtype=">f8"),  # big-endian input
        "model_001/embedding": (np.arange(2048) % 7).astype(np.float32).reshape(256, 8),  # compressible
        "model_001/bn/moving_mean": np.array([-1.0, -0.5, 0.0, 0.5, 1.0], dtype=np.float16),
        "w": np.array([[1, 2], [3, 4]], dtype=np.int64),
        "w/Adagrad": np.full((2, 2), 0.25, dtype=np.float32),
        "step": np.array(1000, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "mask": np.array([True, False, True]),
        "complex": np.array([1 + 2j, -3j], dtype=np.complex64),
        "bf16": np.array([1.0, -2.5, 3.140625], dtype=ml_dtypes.bfloat16),
        "f8": np.array([0.5, -1.0, 448.0], dtype=ml_dtypes.float8_e4m3fn),
        "f8e5m2": np.array([0.25, -57344.0], dtype=ml_dtypes.float8_e5m2),
        "ints/u8": np.array([0, 255], dtype=np.uint8),
        "ints/i8": np.array([-128, 127], dtype=np.int8),
        "ints/u16": np.array([65535], dtype=np.uint16),
        "ints/i32": np.array([-(2**31), 2**31 - 1], dtype=np.int32),
        "ints/u64": np.array([2**64 - 1], dtype=np.uint64),
        "ünïcode/kérnel": np.array([7.0], dtype=np.float64),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    }


def main() -> None:
    """The golden files of the current format version; files already there are never rewritten."""
    version = FORMAT_VERSION
    for suffix, compress in [(".npz", False), ("_compressed.npz", True), (".h5", False), ("_compressed.h5", True),
                             ("_shuffled.npz", "shuffle")]:
        path = HERE / f"golden_v{version}{suffix}"
        if not path.exists():
            ws.save(path, weights(), metadata=METADATA, compress=compress)
    # foreign files, with no manifest: what numpy and h5py write on their own
    if not (HERE / "plain_numpy.npz").exists():
        np.savez(HERE / "plain_numpy.npz", **{"a": np.arange(3, dtype=np.int32), "b": np.eye(2)})
    if not (HERE / "plain_h5py.h5").exists():
        with h5py.File(HERE / "plain_h5py.h5", "w") as f:
            f["layer/kernel"] = np.arange(4, dtype=np.float32).reshape(2, 2)
            f["layer/bias"] = np.array([0.5, -0.5], dtype=">f4")


if __name__ == "__main__":
    main()
