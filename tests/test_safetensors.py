"""safetensors as a weightstore format: round trips, what the safetensors library reads of our
files and we of its, laziness, remote reads, the CLI, and hostile headers (hand-made and fuzzed)."""

from __future__ import annotations

import json
import mmap
import random
import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open
from typer.testing import CliRunner

import weightstore as ws
from weightstore.cli.main import app
from weightstore.formats import safetensors as st_format

SUPPORTED = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
             np.float16, np.float32, np.float64, np.complex64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
             ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e8m0fnu]
#: what the safetensors library's numpy module can hand back (it has no float8 in numpy)
LIBRARY_READS = {np.dtype(d) for d in SUPPORTED[:13]} | {np.dtype(ml_dtypes.bfloat16)}
UNSUPPORTED = [np.complex128, ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.float4_e2m1fn,
               ml_dtypes.float8_e4m3b11fnuz, ml_dtypes.float8_e4m3, ml_dtypes.float6_e2m3fn]


def sample(dtype, shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    size = int(np.prod(shape))
    if dtype == np.bool_:
        return rng.integers(0, 2, size).astype(bool).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True).reshape(shape)
    values = rng.standard_normal(size) * 4
    if dtype.kind == "c":
        values = values + 1j * rng.standard_normal(size)
    return values.astype(dtype).reshape(shape)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes (NaNs and -0.0 included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


def mixed() -> dict[str, np.ndarray]:
    """Odd sizes and mixed item sizes, in an order that would misalign a naive layout."""
    return {"model/flags": sample(np.bool_, (3,)), "model/dense/kernel": sample(np.float32, (5, 3), 1),
            "model/dense/bias": sample(np.float16, (3,), 2), "model/step": np.array(7, np.int64),
            "model/bf": sample(ml_dtypes.bfloat16, (2, 3), 3), "model/empty": np.zeros((0, 4), np.float32),
            "head/w": sample(np.float64, (4, 1), 4)}


def reaches_mmap(array: np.ndarray) -> bool:
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    for _ in range(10):
        if not isinstance(base, memoryview):
            break
        base = base.obj
    return isinstance(base, mmap.mmap)


def header_of(path) -> tuple[int, dict]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length])


# -- round trips and what other readers see ---------------------------------------------------

@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 5)], ids=str)
@pytest.mark.parametrize("dtype", [pytest.param(np.dtype(d), id=np.dtype(d).name) for d in SUPPORTED])
def test_round_trip_through_us_and_the_library(tmp_path, dtype, shape):
    path = tmp_path / "w.safetensors"
    value = sample(dtype, shape)
    ws.save(path, {"a/w": value, "b": np.arange(3, dtype=np.float32)})
    loaded = ws.load(path)
    assert same(loaded["a/w"], value)
    if dtype in LIBRARY_READS:
        assert same(safetensors.numpy.load_file(path)["a/w"], value)
    with safe_open(path, framework="np") as handle:  # every dtype: the header parses and validates
        assert sorted(handle.keys()) == ["a/w", "b"]


def test_metadata_and_key_order_round_trip_and_metadata_is_strings(tmp_path):
    path = tmp_path / "w.safetensors"
    metadata = {"run": "a", "step": 3, "nested": {"lr": [0.1, None, True]}, "text": "ünï\n\"q\""}
    weights = {"z/last": np.ones(2), "a/first": np.zeros(3, np.int8), "m/mid": np.arange(4.0)}
    ws.save(path, weights, metadata=metadata)
    with ws.open(path) as store:
        assert store.metadata == metadata
        assert store.keys() == list(weights)
        assert store.has_checksums and store.created
        assert [store.info(k).checksum.startswith("crc32:") for k in weights] == [True] * 3
    with safe_open(path, framework="np") as handle:
        header_metadata = handle.metadata()
    assert set(header_metadata) == {"weightstore"}
    assert json.loads(header_metadata["weightstore"])["metadata"] == metadata


def test_the_data_starts_64_byte_aligned_and_every_tensor_on_its_item_size(tmp_path):
    path = tmp_path / "w.safetensors"
    ws.save(path, mixed())
    length, header = header_of(path)
    assert (8 + length) % 64 == 0 and length % 8 == 0
    for name, entry in header.items():
        if name != "__metadata__":
            itemsize = st_format._dtype_of_code(entry["dtype"]).itemsize
            assert entry["data_offsets"][0] % itemsize == 0, name
    for key, value in ws.load(path).items():
        assert value.flags.aligned, key


def test_loads_are_read_only_views_of_the_mapped_file(tmp_path):
    path = tmp_path / "w.safetensors"
    ws.save(path, {"big": np.arange(1 << 14, dtype=np.float32), "bf": np.ones(64, ml_dtypes.bfloat16)})
    for source in (ws.load(path), ws.open(path)):
        for key in ("big", "bf"):
            assert reaches_mmap(source[key]) and not source[key].flags.writeable, key
    first = ws.load(path)["big"]
    ws.save(path, {"big": np.zeros(4, np.float32)})  # replaced by rename: the old map stays valid
    assert np.array_equal(first, np.arange(1 << 14, dtype=np.float32))


@pytest.mark.parametrize("dtype", [pytest.param(np.dtype(d), id=np.dtype(d).name) for d in UNSUPPORTED])
def test_dtypes_the_spec_lacks_are_refused_before_anything_is_written(tmp_path, dtype):
    path = tmp_path / "w.safetensors"
    ws.save(path, {"old": np.ones(2, np.float32)})
    before = path.read_bytes()
    with pytest.raises(ws.UnsupportedDTypeError) as caught:
        ws.save(path, {"fine": np.ones(3, np.float32), "odd/one": np.zeros(3, dtype)})
    assert "w.safetensors" in str(caught.value) and "'odd/one'" in str(caught.value)
    assert dtype.name in str(caught.value) and ".npz" in str(caught.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no temporary left behind
    with pytest.raises(ws.UnsupportedDTypeError, match="odd/one"):  # from a store too, from its index
        npz = tmp_path / "src.npz"
        ws.save(npz, {"odd/one": np.zeros(3, dtype)})
        ws.save(tmp_path / "new.safetensors", ws.open(npz))
    assert not (tmp_path / "new.safetensors").exists()


def test_compress_is_refused(tmp_path):
    with pytest.raises(ws.FormatError, match="w.safetensors: safetensors files are never compressed"):
        ws.save(tmp_path / "w.safetensors", {"a": np.ones(2)}, compress=True)
    assert not list(tmp_path.iterdir())


# -- the writer's layouts: held, streamed, moved ------------------------------------------------

@pytest.mark.parametrize("hold,slack,direct", [(1 << 30, 1 << 16, 256 << 10), (64, 1 << 16, 256 << 10),
                                               (64, 0, 256 << 10), (64, 0, 8)],
                         ids=["held", "streamed", "header-outgrows-its-room", "planned-streamed-from-the-first"])
def test_every_writer_layout_is_a_valid_file(tmp_path, monkeypatch, hold, slack, direct):
    """``direct`` 8: every tensor counts as large, written from its memory, and asks the plan
    (the file holds more than ``hold``), so the writer streams from the first tensor, its
    header's room estimated from every planned tensor."""
    monkeypatch.setattr(st_format, "_HOLD_BYTES", hold)
    monkeypatch.setattr(st_format, "_HEADER_SLACK", slack)
    monkeypatch.setattr(st_format, "_DIRECT_BYTES", direct)
    monkeypatch.setattr(st_format, "_PLAN_FROM", direct)
    weights = {f"layer_{i:03d}/" + "k" * 40: sample([np.float32, np.float16, np.int8][i % 3], (i % 7 + 1, 5), i)
               for i in range(150)}
    path = tmp_path / "w.safetensors"
    ws.save(path, weights, metadata={"note": "x" * 5000})
    length, header = header_of(path)
    assert (8 + length) % 64 == 0
    if hold == 64 and slack:  # streamed into the room left: from a page-cache folio's edge
        assert (8 + length) % (64 << 10) == 0
    for key, value in weights.items():
        assert header[key]["data_offsets"][0] % value.dtype.itemsize == 0, key
    loaded = ws.load(path)
    assert list(loaded) == list(weights) and all(same(loaded[k], v) for k, v in weights.items())
    theirs = safetensors.numpy.load_file(path)
    assert all(same(theirs[k], v) for k, v in weights.items())


def test_a_header_padded_past_the_readers_limit_is_never_written(tmp_path, monkeypatch):
    """The length readers check (ours and the library's, 100 MB) counts the header's padding:
    a streamed file reserved twice its estimate, so 30,000 tensors of 1,000-byte names wrote a
    63 MB header padded to 136 MB that nothing read; and a header just under the limit, padded
    to the 64-byte edge, went past it. Here with the limit made small."""
    weights = {f"layer_{i:03d}/" + "k" * 40: sample(np.float32, (3, 5), i) for i in range(150)}
    exact = tmp_path / "exact.safetensors"
    ws.save(exact, weights)
    length, _ = header_of(exact)
    text = exact.read_bytes()[8:8 + length].rstrip(b" ")
    assert (8 + len(text)) % 64  # so padding it passes a limit of its own length
    monkeypatch.setattr(st_format, "MAX_SAFETENSORS_HEADER_BYTES", len(text))
    with pytest.raises(ws.FormatError, match="readers refuse"):
        ws.save(tmp_path / "held.safetensors", weights)
    monkeypatch.setattr(st_format, "MAX_SAFETENSORS_HEADER_BYTES", 100_000)  # under the streamed room
    monkeypatch.setattr(st_format, "_HOLD_BYTES", 64)
    path = tmp_path / "streamed.safetensors"
    ws.save(path, weights)
    assert header_of(path)[0] <= 100_000
    loaded = ws.load(path)
    assert all(same(loaded[k], v) for k, v in weights.items())


def test_saving_a_store_streams_it_into_safetensors_and_back(tmp_path):
    weights = mixed()
    npz = tmp_path / "a.npz"
    ws.save(npz, weights, metadata={"m": 1})
    with ws.open(npz) as source:
        ws.save(tmp_path / "b.safetensors", source, metadata=source.metadata)
    with ws.open(tmp_path / "b.safetensors") as source:
        ws.save(tmp_path / "c.h5", source, metadata=source.metadata)
    back = ws.load(tmp_path / "c.h5")
    assert list(back) == list(weights) and all(same(back[k], v) for k, v in weights.items())


# -- files the safetensors library wrote --------------------------------------------------------

def test_library_files_read_as_foreign_files(tmp_path):
    path = tmp_path / "lib.safetensors"
    weights = {"encoder.layer.0.weight": sample(np.float32, (4, 3)), "encoder/bias": sample(np.float16, (3,)),
               "bf": sample(ml_dtypes.bfloat16, (5,)), "mask": sample(np.bool_, (7,))}
    safetensors.numpy.save_file(weights, str(path), metadata={"format": "pt", "note": "hi"})
    with ws.open(path) as store:
        assert store.keys() == sorted(weights)
        assert store.metadata == {"format": "pt", "note": "hi"}
        assert not store.has_checksums and store.info("bf").checksum is None
        assert store.info("encoder/bias").dtype == "float16" and store.info("bf").shape == (5,)
        for key, value in weights.items():
            assert same(store[key], value), key
    assert list(ws.load(path, scope="encoder")) == ["bias"]


@pytest.mark.parametrize("name", ["a//b", "/lead", "a/../b", "__weightstore__/x", "tab\there"])
def test_library_files_whose_names_are_not_keys_are_refused(tmp_path, name):
    path = tmp_path / "lib.safetensors"
    safetensors.numpy.save_file({name: np.ones(2, np.float32), "fine": np.ones(1)}, str(path))
    with pytest.raises(ws.FormatError) as caught:
        ws.open(path)
    assert "lib.safetensors" in str(caught.value) and repr(name) in str(caught.value)


def test_a_foreign_misaligned_tensor_reads_as_an_aligned_copy(tmp_path):
    odd = np.arange(3, dtype=np.float16)
    after = np.arange(4, dtype=np.float32)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(st_file({"a": entry("F16", [3], 0, 6), "b": entry("F32", [4], 6, 22)},
                             odd.tobytes() + after.tobytes()))
    loaded = ws.load(path)
    assert same(loaded["a"], odd) and same(loaded["b"], after) and loaded["b"].flags.aligned


def test_a_file_without_the_suffix_is_sniffed(tmp_path):
    path = tmp_path / "model.bin"
    safetensors.numpy.save_file({"w": np.ones(3, np.float32)}, str(path))
    assert same(ws.load(path)["w"], np.ones(3, np.float32))
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(ws.FormatError, match="not npz, HDF5 or safetensors"):
        ws.open(tmp_path / "junk.bin")


# -- lazy and selective reads -------------------------------------------------------------------

def corrupt_first_byte(path, name: str) -> None:
    length, header = header_of(path)
    data = bytearray(path.read_bytes())
    data[8 + length + header[name]["data_offsets"][0]] ^= 0x40
    path.write_bytes(bytes(data))


def test_open_reads_only_the_header_and_reads_verify(tmp_path):
    path = tmp_path / "w.safetensors"
    weights = {"keep/w": np.arange(100, dtype=np.float32), "drop/w": np.arange(100, dtype=np.float32)}
    ws.save(path, weights)
    corrupt_first_byte(path, "drop/w")
    with ws.open(path) as store:
        assert store.keys() == list(weights) and store.info("drop/w").shape == (100,)
        assert same(store["keep/w"], weights["keep/w"])
        with pytest.raises(ws.ChecksumError, match="w.safetensors: tensor 'drop/w': is corrupt") as caught:
            store["drop/w"]
        assert (caught.value.path, caught.value.key) == (str(path), "drop/w")
    assert list(ws.load(path, include="keep")) == ["keep/w"]
    assert not np.array_equal(ws.load(path, verify=False)["drop/w"], weights["drop/w"])
    out = np.empty(100, np.float32)
    with ws.open(path) as store:
        assert same(store.read_into("keep/w", out), weights["keep/w"])
        with pytest.raises(ws.ChecksumError):
            store.read_into("drop/w", out)


def many_read(path, keys, *, one_by_one: bool, verify: bool = True) -> tuple:
    """What reading ``keys`` gives, all at once (the reader's ``read_many``) or key by key
    (``read``, the rule): the arrays, or the error's kind, key and message."""
    try:
        with ws.open(path, verify=verify) as store:
            arrays = [store[key] for key in keys] if one_by_one else list(store.read(keys).values())
            assert all(reaches_mmap(a) for a in arrays if a.nbytes)  # views of the map either way
            return "read", [(a.dtype, a.shape, a.tobytes()) for a in arrays]
    except ws.WeightStoreError as exc:
        return type(exc).__name__, exc.key, str(exc)


@pytest.mark.parametrize("seed", range(3))
def test_many_tensors_read_alike_on_either_path(tmp_path, seed):
    """Every dtype, empty and 0-d tensors, one large enough for the parallel CRC, in any order:
    reading many at once gives what reading each alone gives, and with tensors damaged refuses
    with the same error, naming the first damaged key asked for."""
    rng = random.Random(seed)
    weights = {f"t/{i}": sample(dtype, rng.choice([(), (0,), (3,), (2, 5)]), i) for i, dtype in enumerate(SUPPORTED)}
    weights.update({f"u/{i}": sample(np.float32, (rng.randrange(1, 9),), i) for i in range(20)})
    weights["big"] = sample(np.float32, (70_000,), 99)
    path = tmp_path / "m.safetensors"
    ws.save(path, weights)
    keys = rng.sample(list(weights), len(weights) - 3)
    good = many_read(path, keys, one_by_one=True)
    assert good[0] == "read" and many_read(path, keys, one_by_one=False) == good
    assert all(same(np.frombuffer(b, d).reshape(s), weights[k]) for k, (d, s, b) in zip(keys, good[1], strict=True))
    for name in rng.sample([k for k in keys if weights[k].nbytes], 2):
        corrupt_first_byte(path, name)
    refused = many_read(path, keys, one_by_one=True)
    assert refused[0] == "ChecksumError" and refused[1] in keys
    assert many_read(path, keys, one_by_one=False) == refused
    assert many_read(path, keys, one_by_one=False, verify=False) == many_read(path, keys, one_by_one=True, verify=False)


def test_remote_reads_are_ranged(tmp_path, monkeypatch):
    import fsspec

    from weightstore.io import remote

    fs = fsspec.filesystem("memory")
    url = f"memory://st-{tmp_path.name}/w.safetensors"
    weights = {f"layer_{i}/kernel": np.full((128, 128), i, np.float32) for i in range(32)}
    ws.save(url, weights, metadata={"step": 1})
    read = []
    original = remote.RemoteFile.read_at

    def counting(self, offset, length):
        read.append(length)
        return original(self, offset, length)

    monkeypatch.setattr(remote.RemoteFile, "read_at", counting)
    with ws.open(url) as store:
        assert store.metadata == {"step": 1} and len(store.keys()) == 32
        header_bytes = sum(read)
        assert header_bytes < 64 * 1024, header_bytes
        assert np.all(store["layer_7/kernel"] == 7)
    assert sum(read) - header_bytes == 128 * 128 * 4
    assert same(ws.load(url, include="layer_3")["layer_3/kernel"], weights["layer_3/kernel"])
    fs.rm(f"/st-{tmp_path.name}", recursive=True)


# -- the CLI ------------------------------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_ws_convert_to_safetensors_and_back(tmp_path):
    npz = tmp_path / "a.npz"
    weights = mixed()
    ws.save(npz, weights, metadata={"run": "a"})
    st, back = tmp_path / "b.safetensors", tmp_path / "c.npz"
    assert run("convert", npz, st).exit_code == 0
    assert run("convert", st, back).exit_code == 0
    for path in (st, back):
        with ws.open(path) as store:
            assert store.metadata == {"run": "a"}
        assert run("diff", npz, path).exit_code == 0
    theirs = safetensors.numpy.load_file(st)
    assert all(same(theirs[k], v) for k, v in weights.items())
    listing = run("ls", st, "--json")
    assert listing.exit_code == 0 and "model/dense/kernel" in listing.stdout
    assert run("verify", st).exit_code == 0


def test_ws_errors_on_safetensors_are_one_line(tmp_path):
    npz = tmp_path / "a.npz"
    ws.save(npz, {"c": np.ones(2, np.complex128)})
    result = run("convert", npz, tmp_path / "b.safetensors")
    assert result.exit_code == 1 and "'c'" in result.stderr and "complex128" in result.stderr
    assert "Traceback" not in result.output
    (tmp_path / "bad.safetensors").write_bytes(st_file({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)},
                                                       bytes(12)))
    result = run("ls", tmp_path / "bad.safetensors")
    assert result.exit_code == 1 and "bad.safetensors" in result.stderr and "'b'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    ws.save(npz, {"w": np.ones(2, np.float32)})
    result = run("convert", npz, tmp_path / "c.safetensors", "--compress")
    assert result.exit_code == 1 and "never compressed" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "c.safetensors").exists()


# -- hostile headers ----------------------------------------------------------------------------

def entry(dtype, shape, begin, end) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def st_file(header, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file with any header (a dict, or raw text/bytes) and any length field."""
    raw = header if isinstance(header, bytes) else (
        header.encode("utf-8") if isinstance(header, str) else json.dumps(header).encode("utf-8"))
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


F32_2 = entry("F32", [2], 0, 8)
MANIFEST_OF_A = json.dumps({"format": "weightstore", "version": 1, "tensors": {
    "a": {"dtype": "float32", "shape": [2], "checksum": None}}})

HOSTILE = [
    # (id, file bytes, error class, fragments the message must hold)
    ("short", b"\x05\x00\x00", ws.FormatError, ["shorter than its header length"]),
    ("length-past-file", st_file({"a": F32_2}, bytes(8), length=500), ws.FormatError, ["runs past the end"]),
    ("length-absurd", st_file(b"{}", length=2**63), ws.UnsafeFileError, ["limit 100000000"]),
    ("length-over-limit", st_file(b"{}", length=100_000_001), ws.UnsafeFileError, ["limit"]),
    ("not-utf8", st_file(b'{"a\xff": 1}'), ws.FormatError, ["not UTF-8"]),
    ("not-json", st_file(b'{"a": '), ws.FormatError, ["not JSON"]),
    ("nan", st_file(b'{"a": NaN}'), ws.FormatError, ["not JSON"]),
    ("deep", st_file(b"[" * 100_000 + b"]" * 100_000), ws.FormatError, ["not JSON"]),
    ("array", st_file(b"[1, 2]"), ws.FormatError, ["not a JSON object"]),
    ("entry-not-object", st_file({"a": 3}), ws.FormatError, ["'a'", "not described by an object"]),
    ("unknown-dtype", st_file({"a": entry("F128", [2], 0, 32)}, bytes(32)), ws.FormatError, ["'a'", "'F128'"]),
    ("dtype-not-string", st_file({"a": entry(4, [2], 0, 8)}, bytes(8)), ws.FormatError, ["'a'", "unknown dtype"]),
    ("packed-dtype", st_file({"a": entry("F4", [2], 0, 1)}, bytes(1)), ws.FormatError, ["'a'", "packed"]),
    ("negative-dim", st_file({"a": entry("F32", [-2], 0, 8)}, bytes(8)), ws.FormatError, ["'a'", "shape"]),
    ("bool-dim", st_file({"a": entry("F32", [True, 2], 0, 8)}, bytes(8)), ws.FormatError, ["'a'", "shape"]),
    ("float-dim", st_file({"a": entry("F32", [2.0], 0, 8)}, bytes(8)), ws.FormatError, ["'a'", "shape"]),
    ("shape-not-list", st_file({"a": entry("F32", 2, 0, 8)}, bytes(8)), ws.FormatError, ["'a'", "shape"]),
    ("65-dims", st_file({"a": entry("F32", [1] * 65, 0, 4)}, bytes(4)), ws.FormatError, ["'a'", "shape"]),
    ("huge-dims", st_file({"b": entry("F32", [2**40], 0, 8)}, bytes(8)), ws.FormatError,
     ["'b'", "needs 4398046511104 bytes"]),
    ("huge-dims-empty", st_file({"a": entry("F32", [2**62, 2**62, 0], 0, 0)}), ws.FormatError,
     ["'a'", "no array can have"]),
    ("huge-empty", st_file({"a": entry("F32", [2**62, 0], 0, 0)}), ws.FormatError, ["'a'", "no array can have"]),
    ("size-mismatch", st_file({"a": entry("F32", [3], 0, 8)}, bytes(8)), ws.FormatError, ["'a'", "needs 12 bytes"]),
    ("offsets-reversed", st_file({"a": entry("F32", [2], 8, 0)}, bytes(8)), ws.FormatError, ["'a'", "data_offsets"]),
    ("offsets-negative", st_file({"a": entry("F32", [2], -8, 0)}, bytes(8)), ws.FormatError, ["'a'", "data_offsets"]),
    ("offsets-three", st_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}}, bytes(8)),
     ws.FormatError, ["'a'", "data_offsets"]),
    ("offsets-missing", st_file({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)), ws.FormatError, ["'a'"]),
    ("offsets-past-file", st_file({"a": entry("F32", [2**30], 0, 2**32)}, bytes(8)), ws.FormatError,
     ["'a'", "ends at byte 4294967296 of a 8-byte data buffer"]),
    ("overlap", st_file({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, bytes(12)),
     ws.UnsafeFileError, ["'b'", "overlaps"]),
    ("same-range", st_file({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 0, 8)}, bytes(8)),
     ws.UnsafeFileError, ["overlaps"]),
    ("gap", st_file({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, bytes(12)),
     ws.UnsafeFileError, ["'b'", "unindexed"]),
    ("not-from-zero", st_file({"a": entry("F32", [1], 4, 8)}, bytes(8)), ws.UnsafeFileError, ["'a'", "unindexed"]),
    ("trailing-bytes", st_file({"a": entry("F32", [1], 0, 4)}, bytes(8)), ws.UnsafeFileError,
     ["4 bytes after the last tensor"]),
    ("duplicate-names", st_file(f'{{"a": {json.dumps(F32_2)}, "a": {json.dumps(F32_2)}}}', bytes(8)),
     ws.UnsafeFileError, ["'a' twice"]),
    ("duplicate-field", st_file('{"a": {"dtype": "F32", "dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}',
                                bytes(8)), ws.UnsafeFileError, ["'dtype' twice"]),
    ("duplicate-metadata", st_file('{"__metadata__": {"k": "1", "k": "2"}}'), ws.UnsafeFileError, ["'k' twice"]),
    # written compactly, as the library writes headers: parsed by orjson, whose write-back then differs
    ("duplicate-names-compact", st_file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                        b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
     ws.UnsafeFileError, ["'a' twice"]),
    ("metadata-not-object", st_file({"__metadata__": "x"}), ws.FormatError, ["__metadata__"]),
    ("metadata-empty-list", st_file({"__metadata__": []}), ws.FormatError, ["__metadata__"]),
    ("metadata-not-strings", st_file({"__metadata__": {"k": 1}}), ws.FormatError, ["__metadata__", "'k'"]),
    ("manifest-not-json", st_file({"__metadata__": {"weightstore": "{"}, "a": F32_2}, bytes(8)), ws.FormatError,
     ["manifest"]),
    ("manifest-other-tensor", st_file({"__metadata__": {"weightstore": MANIFEST_OF_A}, "b": F32_2}, bytes(8)),
     ws.FormatError, ["disagree", "'a'", "'b'"]),
    ("manifest-other-dtype", st_file({"__metadata__": {"weightstore": MANIFEST_OF_A}, "a": entry("I32", [2], 0, 8)},
                                     bytes(8)), ws.FormatError, ["'a'", "I32", "float32"]),
    ("manifest-other-shape", st_file({"__metadata__": {"weightstore": MANIFEST_OF_A},
                                      "a": entry("F32", [1, 2], 0, 8)}, bytes(8)), ws.FormatError, ["'a'", "shape"]),
]


@pytest.mark.parametrize("data,error,fragments", [pytest.param(*case[1:], id=case[0]) for case in HOSTILE])
def test_hostile_headers_are_refused_naming_file_and_tensor(tmp_path, data, error, fragments):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(error):  # once untraced: first-time imports and caches are not the file's doing
        ws.load(path)
    tracemalloc.start()
    try:
        with pytest.raises(error) as caught:
            ws.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert "bad.safetensors" in message
    for fragment in fragments:
        assert fragment in message, message
    assert peak < len(data) * 3 + (1 << 20), peak  # nothing allocated beyond what the file backs


def test_the_safetensors_library_refuses_our_hostile_layouts_too():
    """Our rules are the library's: the layouts we refuse, it refuses (checked on a few)."""
    for case in HOSTILE:
        if case[0] in ("overlap", "gap", "trailing-bytes", "size-mismatch", "length-past-file", "not-utf8"):
            with pytest.raises(Exception):  # noqa: B017  (the library raises its own SafetensorError)
                safetensors.numpy.load(case[1])


@pytest.mark.parametrize("text", [" \n" + json.dumps({"a": F32_2}) + "   ",
                                  json.dumps({"__metadata__": None, "a": F32_2})], ids=["whitespace", "null-metadata"])
def test_what_the_library_accepts_we_accept(tmp_path, text):
    path = tmp_path / "ok.safetensors"
    path.write_bytes(st_file(text, np.arange(2, dtype=np.float32).tobytes()))
    safetensors.numpy.load_file(path)
    assert same(ws.load(path)["a"], np.arange(2, dtype=np.float32))
    assert ws.open(path).metadata == {}


def test_mutation_fuzz_only_raises_weightstore_errors_and_never_returns_wrong_data(tmp_path):
    path = tmp_path / "w.safetensors"
    weights = mixed()
    ws.save(path, weights, metadata={"run": "fuzz"})
    original = path.read_bytes()
    header_end = 8 + struct.unpack("<Q", original[:8])[0]
    rng = random.Random(9)
    target = tmp_path / "m.safetensors"
    outcomes = {"read": 0, "refused": 0}
    for _ in range(400):
        data = bytearray(original)
        kind = rng.random()
        if kind < 0.5:  # most mutants hit the header, where the parsing is
            data[rng.randrange(header_end)] = rng.randrange(256)
        elif kind < 0.7:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind < 0.8:
            data[:8] = struct.pack("<Q", rng.choice([0, 1, header_end, header_end - 16, len(data), 2**40]))
        elif kind < 0.9:
            del data[rng.randrange(len(data)):]
        else:
            position = rng.randrange(len(data))
            data[position:position] = bytes(rng.randrange(1, 9))
        target.write_bytes(bytes(data))
        try:
            loaded = ws.load(target)
        except ws.WeightStoreError:
            outcomes["refused"] += 1
            continue
        outcomes["read"] += 1
        # A flipped byte in the name "weightstore" under __metadata__ leaves a valid foreign
        # file (its keys in sorted order): the tensors must still be the original's.
        assert sorted(loaded) == sorted(weights)
        assert all(same(loaded[k], v) for k, v in weights.items())
    assert outcomes["read"] and outcomes["refused"] > 200, outcomes


def test_publish_safetensors_versions(tmp_path):
    folder = tmp_path / "run"
    ws.publish(folder, {"w": np.arange(3, dtype=np.float32)}, step=1, format="safetensors")
    latest = ws.latest(folder)
    assert latest.path.endswith(".safetensors")
    assert same(ws.load(latest)["w"], np.arange(3, dtype=np.float32))
    with pytest.raises(ws.UnsupportedDTypeError, match="step-000000000002.safetensors: tensor 'c'"):
        ws.publish(folder, {"c": np.ones(2, np.complex128)}, step=2, format="safetensors")
    assert ws.latest(folder).step == 1


def test_an_empty_dictionary_is_a_valid_file(tmp_path):
    path = tmp_path / "empty.safetensors"
    ws.save(path, {}, metadata={"k": "v"})
    assert ws.load(path) == {} and safetensors.numpy.load_file(path) == {}
    with ws.open(path) as store:
        assert store.metadata == {"k": "v"}


# -- a header length that starts like a pickle -------------------------------------------------

#: header lengths whose first two bytes (little-endian) are pickle's magic, ``80 02`` to ``80 05``
PICKLE_LIKE_LENGTHS = [640, 896, 1152, 1408, 65536 + 640, 65536 + 1408]


def header_length(path) -> int:
    with open(path, "rb") as handle:
        return struct.unpack("<Q", handle.read(8))[0]


def saved_with_header_of(path, weights: dict, length: int) -> None:
    """``weights`` as the safetensors library saves them, padded with metadata to a header of
    exactly ``length`` bytes (the library pads headers to a multiple of 8, as these are)."""
    safetensors.numpy.save_file(weights, str(path), metadata={"pad": ""})
    least = header_length(path) - 8  # each character of padding adds one byte before the multiple of 8
    for pad in range(max(0, length - least - 8), length - least + 1):
        safetensors.numpy.save_file(weights, str(path), metadata={"pad": "x" * pad})
        if header_length(path) == length:
            return
    raise AssertionError(f"no padding gives a header of {length} bytes")


@pytest.mark.parametrize("length", PICKLE_LIKE_LENGTHS)
def test_a_valid_file_whose_header_length_starts_like_a_pickle_is_read_as_safetensors(tmp_path, length):
    """Such a file was refused as "a Python pickle (protocol 2)": the pickle check looked at the
    first bytes before the safetensors reader could read the file its suffix names."""
    weights = {"conv/weight": sample(np.float32, (4, 3, 3, 3)), "bn/running_mean": sample(np.float32, (4,), 1)}
    path = tmp_path / "model.safetensors"
    saved_with_header_of(path, weights, length)
    with open(path, "rb") as handle:
        assert handle.read(2) in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
    loaded = ws.load(path)
    assert sorted(loaded) == sorted(weights) and all(same(loaded[k], v) for k, v in weights.items())
    with ws.open(path) as store:
        assert same(store["conv/weight"], weights["conv/weight"])
    result = run("ls", path)
    assert result.exit_code == 0, result.output
    assert "conv/weight" in result.output and "pickle" not in result.output
    unnamed = tmp_path / "model.weights"  # no suffix to go by: the magic says safetensors, and so does the file
    unnamed.write_bytes(path.read_bytes())
    assert same(ws.load(unnamed)["bn/running_mean"], weights["bn/running_mean"])


@pytest.mark.parametrize("name", ["model.safetensors", "model.weights"])
def test_a_pickle_named_or_shaped_as_safetensors_is_still_refused_as_a_pickle_unread(tmp_path, name):
    """The safetensors reader reads first now; a pickle it refuses is still named as a pickle,
    and never unpickled."""
    import pickle

    made = tmp_path / "made-by-unpickling"

    class MakesAFile:
        def __reduce__(self):
            return (open, (str(made), "w"))

    for protocol in (2, 3, 4, 5):
        path = tmp_path / name
        path.write_bytes(pickle.dumps({"w": MakesAFile()}, protocol=protocol))
        with pytest.raises(ws.FormatError, match=rf"is a Python pickle \(protocol {protocol}\).*never unpickles") as caught:
            ws.load(path)
        assert caught.value.path == str(path)
        result = run("ls", path)
        assert result.exit_code == 1 and "never unpickles" in result.output
    assert not made.exists()
