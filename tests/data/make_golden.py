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
    deltas()


#: the golden delta versions, each a change of the anchor (step 1) by one codec; their tensors
#: are :func:`delta_weights`' (``tests/test_golden.py`` spells out their digests)
DELTA_CODECS = {2: "same", 3: "raw", 4: "xor-zstd", 5: "sparse", 6: "xor-top"}


def delta_weights(step: int) -> np.ndarray:
    """Step ``step``'s tensor ``w`` (1024 fp32: above the size xor-top keeps its top plane apart for)."""
    w = ((np.arange(1024) % 97) / 8 - 6).astype(np.float32)
    if step in (1, 2):
        return w
    if step == 3:
        return (np.arange(1024, dtype=np.uint32) * np.uint32(2654435761)).view(np.float32)  # bits that do not compress
    if step == 5:
        spots = np.arange(20) * 997 % 1024  # 20 elements changed to bits that do not compress
        w[spots] = (np.arange(20, dtype=np.uint32) * np.uint32(2654435761)).view(np.float32)
        return w
    return (w * np.float32(1.001)).astype(np.float32)


def deltas() -> None:
    """``delta/``: the anchor and one delta version per codec, each based on the anchor."""
    import io

    from weightstore.core.manifest import content_digest, crc32, dtype_name
    from weightstore.formats import delta

    folder = HERE / "delta"
    folder.mkdir(exist_ok=True)
    anchor = "step-000000000001.npz"
    if not (folder / anchor).exists():
        ws.save(folder / anchor, {"w": delta_weights(1)})
    base = delta_weights(1).view(np.uint8)
    for step, codec in DELTA_CODECS.items():
        path = folder / f"step-{step:012d}.wsdelta"
        if path.exists():
            continue
        new = delta_weights(step)
        raw = new.view(np.uint8)
        encoded = delta.encode(raw, None if codec == "raw" else base, 4, dense=codec == "xor-top")
        assert encoded.codec == codec, (step, encoded.codec)
        buffer = io.BytesIO()
        delta.write(buffer, delta.Head(step, anchor, [anchor], encoded.nbytes, raw.nbytes),
                    [("w", dtype_name(new.dtype), new.shape, crc32(raw))], [content_digest(raw)], [encoded],
                    {"codec": codec}, "weightstore golden", "2026-12-07T00:00:00.000Z")
        path.write_bytes(buffer.getvalue())


if __name__ == "__main__":
    main()
