"""compress="shuffle" (byte shuffle + zstd npz members) and checksums taken in the write pass."""

from __future__ import annotations

import io
import json
import struct
import zipfile

import h5py
import ml_dtypes
import numpy as np
import pytest
import zstandard

import hostile
import weightstore as ws
from weightstore.core.manifest import build_manifest, checksum, parse_manifest
from weightstore.errors import ChecksumError, FormatError, TargetError
from weightstore.formats import _shuffle_zstd
from weightstore.formats import npz as npz_format
from weightstore.formats import safetensors as safetensors_format

SUFFIX = _shuffle_zstd.MEMBER_SUFFIX


def trained_like(shape, seed=0) -> np.ndarray:
    """float32 normal(0, 0.05) moved by a few SGD-like steps: what real kernels look like to a compressor."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(0, 0.05, shape).astype(np.float32)
    for _ in range(3):
        weights -= np.float32(0.01) * rng.standard_normal(shape, dtype=np.float32) * np.abs(weights)
    return weights


def weights(dtype=np.float32) -> dict[str, np.ndarray]:
    return {
        "dense/kernel": trained_like((768, 512)).astype(dtype),  # 1.5 MB as float32: two blocks
        "dense/bias": trained_like((512,), seed=1).astype(dtype),
        "step": np.array(7, np.int64),
        "empty": np.zeros((0, 4), dtype),
    }


def manifest_of(path) -> dict:
    with zipfile.ZipFile(path) as archive:
        raw = archive.read("__weightstore__.npy")
    return json.loads(np.lib.format.read_array(io.BytesIO(raw)).item())


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64, np.int8, np.complex64])
def test_shuffle_round_trips_exactly(tmp_path, dtype):
    path = tmp_path / "m.npz"
    original = weights(dtype)
    ws.save(path, original, compress="shuffle")
    loaded = ws.load(path)
    for key, value in original.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape
        assert loaded[key].tobytes() == value.tobytes()
    assert loaded["dense/kernel"].flags.writeable  # decoded into memory the array owns
    with ws.open(path) as store:  # read_into must decode too, never copy the encoded bytes
        out = np.empty_like(original["dense/kernel"])
        store.read_into("dense/kernel", out)
        assert out.tobytes() == original["dense/kernel"].tobytes()


@pytest.mark.parametrize(("dtype", "least"), [(np.float32, 1.17), (ml_dtypes.bfloat16, 1.40)])
def test_shuffle_reaches_its_ratio_on_trained_like_weights(tmp_path, dtype, least):
    kernel = {"kernel": trained_like((1024, 1024)).astype(dtype)}
    plain, shuffled, deflated = tmp_path / "p.npz", tmp_path / "s.npz", tmp_path / "d.npz"
    ws.save(plain, kernel)
    ws.save(shuffled, kernel, compress="shuffle")
    ws.save(deflated, kernel, compress=True)
    ratio = plain.stat().st_size / shuffled.stat().st_size
    assert ratio >= least
    assert shuffled.stat().st_size < deflated.stat().st_size


def test_manifest_records_the_codec_and_plain_checksum(tmp_path):
    path = tmp_path / "m.npz"
    original = weights()
    ws.save(path, original, compress="shuffle")
    entries = hostile.manifest_entries(manifest_of(path))
    assert entries["dense/kernel"]["codec"] == "shuffle-zstd"
    assert entries["dense/kernel"]["checksum"] == checksum(original["dense/kernel"])
    assert "codec" not in entries["step"] and "codec" not in entries["empty"]  # 0-d and empty stay npy


def test_np_load_never_returns_shuffled_bytes_as_an_array(tmp_path):
    path = tmp_path / "m.npz"
    ws.save(path, weights(), compress="shuffle")
    with np.load(path, allow_pickle=False) as archive:
        assert "dense/kernel" + SUFFIX in archive.files
        with pytest.raises(KeyError):
            archive["dense/kernel"]
        raw = archive["dense/kernel" + SUFFIX]
        assert not isinstance(raw, np.ndarray) and raw.startswith(_shuffle_zstd.MAGIC)
        assert archive["step"] == 7  # tensors left as npy still read
    with zipfile.ZipFile(path) as archive:  # plain zip tools check the stored bytes' CRC
        assert archive.testzip() is None


def test_hdf5_shuffle_is_gzip_and_shuffle_filters_h5py_reads(tmp_path):
    path = tmp_path / "m.h5"
    original = weights()
    ws.save(path, original, compress="shuffle")
    with h5py.File(path, "r") as f:
        dataset = f["dense/kernel"]
        assert dataset.shuffle and dataset.compression == "gzip"
        np.testing.assert_array_equal(dataset[()], original["dense/kernel"])
    assert ws.load(path)["dense/kernel"].tobytes() == original["dense/kernel"].tobytes()


@pytest.mark.parametrize("compress", [False, True])
def test_hdf5_tensor_of_many_write_blocks_reads_back_in_h5py_and_verified(tmp_path, compress):
    """A tensor over 4 MB is written in blocks of rows (of whole chunks when compressed)."""
    path = tmp_path / "m.h5"
    kernel = trained_like((1500, 1031))  # 6.2 MB: two blocks, the last a part
    ws.save(path, {"dense/kernel": kernel}, compress=compress)
    with h5py.File(path, "r") as f:
        assert f["dense/kernel"].compression == ("gzip" if compress else None)
        np.testing.assert_array_equal(f["dense/kernel"][()], kernel)
    assert ws.load(path)["dense/kernel"].tobytes() == kernel.tobytes()


@pytest.mark.parametrize("compress", ["zstd", 2, "True", None, np.array([True, False])])
def test_unknown_compress_option_is_refused_naming_the_file(tmp_path, compress):
    path = tmp_path / "m.npz"
    with pytest.raises(TargetError, match="m.npz"):
        ws.save(path, weights(), compress=compress)
    assert not path.exists()


def test_safetensors_refuses_shuffle(tmp_path):
    with pytest.raises(FormatError, match="m.safetensors"):
        ws.save(tmp_path / "m.safetensors", weights(), compress="shuffle")


@pytest.mark.parametrize("version", [1, 2])
def test_unknown_codec_in_manifest_is_a_format_error(version):
    tensors = ({"a": {"dtype": "float32", "shape": [2], "checksum": None, "codec": "lz77-magic"}} if version == 1 else
               {"keys": ["a"], "dtypes": ["float32"], "dtype": [0], "ndim": [1], "shape": [2], "crc32": [0],
                "codec": {"a": "lz77-magic"}})
    text = json.dumps({"format": "weightstore", "version": version, "tensors": tensors})
    with pytest.raises(FormatError, match="codec of 'a'"):
        parse_manifest(text, "x.npz")


def _member_data(path, name: str) -> tuple[int, int]:
    """(offset, length) of a stored member's bytes in the file."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def test_damaged_frame_is_caught_naming_file_and_key(tmp_path):
    path = tmp_path / "m.npz"
    ws.save(path, weights(), compress="shuffle")
    offset, length = _member_data(path, "dense/kernel" + SUFFIX)
    data = bytearray(path.read_bytes())
    data[offset + length - 100] ^= 0x5A  # inside the last block's compressed data
    path.write_bytes(bytes(data))
    with pytest.raises((ChecksumError, FormatError), match=r"m\.npz.*dense/kernel"):
        ws.load(path)


def test_damaged_block_table_is_a_format_error(tmp_path):
    path = tmp_path / "m.npz"
    ws.save(path, weights(), compress="shuffle")
    offset, _ = _member_data(path, "dense/kernel" + SUFFIX)
    data = bytearray(path.read_bytes())
    data[offset + 28] ^= 0x01  # the first block's length
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"m\.npz.*dense/kernel"):
        ws.load(path, verify=False)


def _blob(itemsize: int, nbytes: int, frames: list[bytes], block: int = 1 << 20) -> memoryview:
    head = struct.pack("<8sIIQI", _shuffle_zstd.MAGIC, itemsize, block, nbytes, len(frames))
    return memoryview(head + struct.pack(f"<{len(frames)}I", *map(len, frames)) + b"".join(frames))


def test_frame_that_inflates_past_its_block_is_refused():
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (8 << 20))  # 8 MB of zeros in a few hundred bytes
    with pytest.raises(FormatError, match="does not declare"):
        _shuffle_zstd.decode(_blob(4, 1 << 20, [bomb]), 4, 1 << 20, "m.npz", "k")


def test_frame_without_content_size_is_refused():
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 1024)
    with pytest.raises(FormatError, match="m.npz: tensor 'k'"):
        _shuffle_zstd.decode(_blob(4, 1024, [frame]), 4, 1024, "m.npz", "k")


def test_header_disagreeing_with_manifest_is_refused():
    frame = zstandard.ZstdCompressor().compress(b"\0" * 1024)
    with pytest.raises(FormatError, match="manifest entry says"):
        _shuffle_zstd.decode(_blob(4, 1024, [frame]), 4, 2048, "m.npz", "k")
    with pytest.raises(FormatError, match="shuffle-zstd header"):
        _shuffle_zstd.decode(_blob(4, 1024, [frame], block=3), 4, 1024, "m.npz", "k")


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors"])
@pytest.mark.parametrize("compress", [False, True])
def test_checksums_from_the_write_pass_match_the_data(tmp_path, suffix, compress, monkeypatch):
    """Tensors over several checksum chunks (and HDF5 write blocks; a row larger than one), streamed
    (safetensors past its hold limit) or not."""
    if suffix == ".safetensors" and compress:
        pytest.skip("safetensors is never compressed")
    monkeypatch.setattr(safetensors_format, "_HOLD_BYTES", 1 << 20)
    original = {"big": trained_like((2100, 700)), "odd": np.arange(1000003, dtype=np.int8),
                "wide": np.arange(6_000_000, dtype=np.int8).reshape(2, -1), "small": np.arange(6, dtype=np.float64)}
    path = tmp_path / f"m{suffix}"
    ws.save(path, original, compress=compress)
    with ws.open(path) as store:
        for key, value in original.items():
            assert store.info(key).checksum == checksum(value)
            assert store[key].tobytes() == value.tobytes()


@pytest.mark.parametrize("compress", [False, True, "shuffle"])
def test_local_headers_patched_after_the_write_agree_with_the_directory(tmp_path, compress):
    """Streaming zip readers trust the local header's CRC and sizes, written before the data."""
    path = tmp_path / "m.npz"
    ws.save(path, {"big": trained_like((1100, 700)), "small": np.arange(5.0)}, compress=compress)
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            crc, compressed, size = struct.unpack_from("<III", raw, info.header_offset + 14)
            assert (crc, compressed, size) == (info.CRC, info.compress_size, info.file_size), info.filename


def test_shuffled_member_without_a_manifest_is_refused(tmp_path):
    path = tmp_path / "m.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("a" + SUFFIX, _shuffle_zstd.MAGIC + b"\0" * 64)
    with pytest.raises(FormatError, match=r"m\.npz.*'a\.shuffled-zstd'"):
        ws.open(path)


@pytest.mark.parametrize(("compress", "codecs"), [("shuffle", None), (False, {"k": "shuffle-zstd"})])
def test_member_and_manifest_codec_must_agree(tmp_path, compress, codecs):
    """A shuffled member the manifest calls plain, or a plain one it calls shuffled, is refused."""
    path = str(tmp_path / "m.npz")
    data = trained_like((64, 32))
    writer = npz_format.NpzWriter(path, compress)
    crc = writer.add("k", "float32", data)
    writer.commit(build_manifest([("k", "float32", data.shape, crc)], {}, "test", None, codecs))
    with ws.open(path) as store, pytest.raises(FormatError, match=r"m\.npz.*'k'.*codec"):
        store["k"]
