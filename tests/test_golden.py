"""Golden files written by weightstore 0.1 (format versions 1 and 2): every later version reads them.

The files in ``tests/data`` were written once per format version by ``tests/data/make_golden.py``
and committed (version 2 holds the manifest's tensors as columns).
The expected values below are spelled out, not recomputed by that script, so a change in how
either side encodes a value shows up here.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest

import hostile
import weightstore as ws
from weightstore.core.manifest import checksum

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = [f"golden_v{version}{suffix}" for version in (1, 2)
          for suffix in (".npz", "_compressed.npz", ".h5", "_compressed.h5", "_shuffled.npz")]

#: key -> (dtype name, shape, values as a flat Python list)
EXPECTED = {
    "model_001/dense/kernel": ("float32", (3, 4), [0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1, 1.125, 1.25, 1.375]),
    "model_001/dense/bias": ("float64", (3,), [-1.5, 0.0, 2.25]),
    "model_001/embedding": ("float32", (256, 8), [i % 7 for i in range(2048)]),
    "model_001/bn/moving_mean": ("float16", (5,), [-1.0, -0.5, 0.0, 0.5, 1.0]),
    "w": ("int64", (2, 2), [1, 2, 3, 4]),
    "w/Adagrad": ("float32", (2, 2), [0.25] * 4),
    "step": ("int64", (), [1000]),
    "empty": ("float32", (0, 3), []),
    "mask": ("bool", (3,), [True, False, True]),
    "complex": ("complex64", (2,), [1 + 2j, -3j]),
    "bf16": ("bfloat16", (3,), [1.0, -2.5, 3.140625]),
    "f8": ("float8_e4m3fn", (3,), [0.5, -1.0, 448.0]),
    "f8e5m2": ("float8_e5m2", (2,), [0.25, -57344.0]),
    "ints/u8": ("uint8", (2,), [0, 255]),
    "ints/i8": ("int8", (2,), [-128, 127]),
    "ints/u16": ("uint16", (1,), [65535]),
    "ints/i32": ("int32", (2,), [-(2**31), 2**31 - 1]),
    "ints/u64": ("uint64", (1,), [2**64 - 1]),
    "ünïcode/kérnel": ("float64", (1,), [7.0]),
    "fortran": ("int16", (2, 3), [0, 1, 2, 3, 4, 5]),
}
#: raw little-endian bytes of the kinds whose encoding is easy to get subtly wrong
EXPECTED_BYTES = {
    "bf16": bytes.fromhex("803f20c04940"),
    "f8": bytes.fromhex("30b87e"),
    "f8e5m2": bytes.fromhex("34fb"),
    "model_001/dense/bias": bytes.fromhex("000000000000f8bf" "0000000000000000" "0000000000000240"),
}
METADATA = {"step": 1000, "note": "golden v1 ✓", "nested": {"lr": 0.001, "list": [1, 2.5, None, True]}}


def _dtype(name):
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) and name.startswith(("bfloat", "float8")) else np.dtype(name)


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_file_reads_exactly(name):
    path = DATA / name
    loaded = ws.load(path)
    assert list(loaded) == list(EXPECTED)
    for key, (dtype, shape, values) in EXPECTED.items():
        array = loaded[key]
        assert array.dtype == _dtype(dtype), key
        assert array.shape == shape, key
        flat = array.reshape(-1)
        got = [float(x) for x in flat] if dtype.startswith(("bfloat", "float8")) else flat.tolist()
        assert got == values, key
    for key, raw in EXPECTED_BYTES.items():
        assert loaded[key].astype(loaded[key].dtype.newbyteorder("<")).tobytes() == raw, key


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_manifest(name):
    path = DATA / name
    with ws.open(path) as store:
        assert store.metadata == METADATA
        assert store.has_checksums
        assert store.created.startswith("20")
        assert list(store.keys()) == list(EXPECTED)
        for key, (dtype, shape, _) in EXPECTED.items():
            info = store.info(key)
            assert (info.dtype, info.shape) == (dtype, shape), key
            assert info.nbytes == int(np.prod(shape)) * _dtype(dtype).itemsize
            assert info.checksum == checksum(np.ascontiguousarray(store[key])), key


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_selection(name):
    loaded = ws.load(DATA / name, scope="model_001", include="fc", mapping="dense=fc")
    assert list(loaded) == ["fc/kernel", "fc/bias"]
    assert ws.load(DATA / name, include="w")["w/Adagrad"].tolist() == [[0.25, 0.25], [0.25, 0.25]]


def _entry(manifest: dict, key: str) -> dict:
    """A tensor's manifest entry, as version 1 wrote it or as version 2's columns give it."""
    return manifest["tensors"][key] if manifest["version"] == 1 else hostile.manifest_entries(manifest)[key]


@pytest.mark.parametrize("name", [f"golden_v{v}{s}" for v in (1, 2) for s in (".npz", "_compressed.npz")])
def test_golden_npz_without_weightstore(name):
    with np.load(DATA / name, allow_pickle=False) as archive:
        assert archive["w"].tolist() == [[1, 2], [3, 4]]
        assert archive["model_001/dense/bias"].dtype == np.dtype("<f8")
        assert archive["bf16"].dtype == np.dtype("V2") and archive["bf16"].tobytes() == EXPECTED_BYTES["bf16"]
        manifest = json.loads(str(archive["__weightstore__"]))
    assert manifest["format"] == "weightstore" and manifest["version"] == int(name[len("golden_v")])
    assert _entry(manifest, "bf16")["dtype"] == "bfloat16"
    with zipfile.ZipFile(DATA / name) as archive:
        assert archive.testzip() is None


@pytest.mark.parametrize("name", ["golden_v1_shuffled.npz", "golden_v2_shuffled.npz"])
def test_golden_shuffled_npz_without_weightstore(name):
    """numpy reads the manifest and the tensors left as npy (0-d, empty), and hands the shuffled
    members back as bytes under their own names, never as arrays."""
    with np.load(DATA / name, allow_pickle=False) as archive:
        assert archive["step"] == 1000 and archive["empty"].shape == (0, 3)
        assert "w" not in archive and "w.shuffled-zstd" in archive.files
        assert isinstance(archive["w.shuffled-zstd"], bytes)
        manifest = json.loads(str(archive["__weightstore__"]))
    assert _entry(manifest, "w")["codec"] == "shuffle-zstd"
    with zipfile.ZipFile(DATA / name) as archive:
        assert archive.testzip() is None


@pytest.mark.parametrize("name", [f"golden_v{v}{s}" for v in (1, 2) for s in (".h5", "_compressed.h5")])
def test_golden_h5_without_weightstore(name):
    with h5py.File(DATA / name, "r") as f:
        manifest = json.loads(f.attrs["weightstore"])
        assert f["model_001/dense/kernel"][1, 2] == 0.75
        assert f[_entry(manifest, "w")["location"]][()].tolist() == [[1, 2], [3, 4]]
        assert f["w/Adagrad"][()].tolist() == [[0.25, 0.25], [0.25, 0.25]]
        assert f["bf16"][()].tobytes() == EXPECTED_BYTES["bf16"]
        if "compressed" in name:
            assert f["model_001/embedding"].compression == "gzip"
    assert manifest["version"] == int(name[len("golden_v")])


def test_plain_numpy_npz_without_manifest():
    with ws.open(DATA / "plain_numpy.npz") as store:
        assert not store.has_checksums and store.metadata == {}
        assert sorted(store.keys()) == ["a", "b"]
        assert store.info("a").dtype == "int32"
    loaded = ws.load(DATA / "plain_numpy.npz")
    assert loaded["a"].tolist() == [0, 1, 2] and loaded["a"].dtype == np.int32
    assert loaded["b"].tolist() == [[1.0, 0.0], [0.0, 1.0]]


def test_plain_h5py_file_without_manifest():
    loaded = ws.load(DATA / "plain_h5py.h5")
    assert sorted(loaded) == ["layer/bias", "layer/kernel"]
    assert loaded["layer/kernel"].tolist() == [[0, 1], [2, 3]]
    assert loaded["layer/bias"].tolist() == [0.5, -0.5]
    assert loaded["layer/bias"].dtype.isnative
    assert list(ws.load(DATA / "plain_h5py.h5", scope="layer", include="bias")) == ["bias"]


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_survives_a_rewrite(tmp_path, name):
    """Read golden, write it again in each format: the values and metadata come through."""
    with ws.open(DATA / name) as store:
        weights = {key: store[key] for key in store}
        metadata = store.metadata
    for suffix in (".npz", ".h5"):
        out = tmp_path / f"again{suffix}"
        ws.save(out, weights, metadata=metadata)
        again = ws.load(out)
        assert list(again) == list(EXPECTED)
        for key in EXPECTED:
            assert again[key].dtype == weights[key].dtype
            assert again[key].tobytes() == weights[key].tobytes(), key


#: ``tests/data/delta``: the anchor, then one delta version per codec (``make_golden.deltas``),
#: each a change of the anchor: step -> (codec, head version, SHA-256 of ``w``'s bytes)
DELTAS = {
    2: ("same", 1, "1416b795f8f7049463acafb286c843967a9a84a1a704477662884eff71873408"),
    3: ("raw", 1, "1fb2cb018b3ced755124cd48ab945b5746353cd060e813ed8919bb5bb7b3e42a"),
    4: ("xor-zstd", 1, "ebc255a1e039bf952feafaf5a6c941fae5ebb606ea0f2c397f1843bd2d564326"),
    5: ("sparse", 1, "153d74d584fb14dac4aca10280883036f299ba6e91df30a5cf2c23ecd2bb0a2f"),
    6: ("xor-top", 2, "ebc255a1e039bf952feafaf5a6c941fae5ebb606ea0f2c397f1843bd2d564326"),
}


@pytest.mark.parametrize("step", sorted(DELTAS))
def test_golden_delta_version_reads_bit_exact(step):
    """Every codec a delta version was written with reads back to the bytes its writer had, and
    only an xor-top entry makes the head version 2 (a reader from before it says it is newer)."""
    import hashlib

    codec, version, digest = DELTAS[step]
    path = DATA / "delta" / f"step-{step:012d}.wsdelta"
    assert json.loads(path.read_bytes()[32:].split(b"}", 1)[0] + b"}")["version"] == version
    with ws.open(path) as store:
        assert store._reader.codec("w") == codec and store.metadata == {"codec": codec}
        w = store["w"]
    assert w.dtype == np.float32 and w.shape == (1024,)
    assert hashlib.sha256(w.tobytes()).hexdigest() == digest
    anchor = ws.load(DATA / "delta" / "step-000000000001.npz")["w"]
    assert anchor.tolist() == [(i % 97) / 8 - 6 for i in range(1024)]
