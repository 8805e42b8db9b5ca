"""Entry points a fuzzer feeds bytes to, and the one property each must keep.

Each target writes the bytes where a user's file would be and reads them the way a user
would: open, list, describe and read every tensor with verification on (or, for a versions
folder, read its ``LATEST`` pointer). The property: the reader either raises a
:class:`~weightstore.errors.WeightStoreError` subclass, or returns exactly what the unmutated
file holds. Anything else (another exception, different arrays) is a finding.

Targets with a ``reader`` feed one parser its bytes (a TF2 object graph, a ``.keras`` config)
or read two ways (the npz fast path against ``np.load``): the property is then that the reader
returns or raises a WeightStoreError, and that the two ways agree. A file that is more than
one (a TF checkpoint's ``.index`` and data) keeps its other files beside each mutant.

Targets with ``mutated`` fuzz one file of a folder that holds several (a delta version over
its bases, a sharded version's done-record, block table or member, a Hugging Face index):
each mutant replaces that file, and what a user opens (the version, the folder; after a
commit, for a done-record) is read. A finding there is kept as the mutant alone, which a
regression test must put back in its folder (the replay of ``tests/data/regressions`` reads
lone files).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import weightstore as ws


def sample_weights() -> dict[str, np.ndarray]:
    """Small, but with every feature a header describes: dtypes, 0-d, empty, nested and ``VALUE`` keys."""
    return {
        "dense/kernel": np.arange(48, dtype=np.float32).reshape(6, 8),
        "dense/bias": np.linspace(-1, 1, 8),
        "dense": np.array(3, dtype=np.int16),  # a key that is also a scope (HDF5 VALUE dataset)
        "emb": np.arange(5000, dtype=np.uint8).reshape(50, 100),  # compressible
        "flags": np.array([True, False, True]),
        "empty": np.zeros((0, 3), np.float16),
    }


@dataclass
class Target:
    """One file shape to fuzz: how to make its seed file, and where a mutant is written to be read."""

    name: str
    suffix: str
    make_seed: Callable[[Path], None]
    #: a file inside a folder of several (a delta and its bases, a sharded version's records):
    #: ``make_seed`` makes the folder, a mutant replaces its file ``mutated``, and ``opened``
    #: (given the folder; it may commit first) says what is read, the mutant alone if None
    mutated: str | None = None
    opened: Callable[[Path], Path] | None = None
    #: what a mutant is made into before it is read: a seal or sizes made anew, as a hostile
    #: writer would make them, so that mutations reach the parser behind them
    fixup: Callable[[bytes], bytes] | None = None
    #: whether the format checks its manifest, so metadata too must read back unchanged (HDF5 keeps
    #: the manifest in an attribute no checksum covers: a changed metadata value reads as changed)
    checks_metadata: bool = True
    #: reads a mutant its own way (returns, or raises a WeightStoreError; Finding on disagreement)
    reader: Callable[[Path], object] | None = None

    def seed(self, folder: Path) -> bytes:
        path = folder / f"seed-{self.name}{self.suffix}"
        self.make_seed(path)
        return path.read_bytes()


def many_weights() -> dict[str, np.ndarray]:
    """Enough small tensors (40) that a whole-file read takes the npz reader's batch path."""
    weights = {f"layer_{i:02d}/w": np.arange(i, i + 6, dtype=np.float32).reshape(2, 3) for i in range(36)}
    return weights | {k: v for k, v in sample_weights().items() if k != "emb"}


def _save_plain_numpy(path: Path) -> None:
    with open(path, "wb") as handle:  # np.savez would add ".npz" to a str path
        np.savez(handle, **{k.replace("/", "."): v for k, v in sample_weights().items()})


def _save_checkpoint(path: Path) -> None:
    """A TF1-style checkpoint (index and one data file) of float tensors, one of them empty."""
    import tf_forge

    tf_forge.write(path.with_suffix(""), {"dense/kernel": np.arange(48, dtype=np.float32).reshape(6, 8),
                                          "dense/bias": np.linspace(-1, 1, 8), "empty": np.zeros((0, 3))})


def rich_checkpoint(tree: Path, data: bytes | None = None) -> Path:
    """A TF2 checkpoint in ``tree`` with an entry of each kind its data file holds: bf16, int8,
    int64 and empty tensors, a variable partitioned into two slices, a string tensor, and the
    object graph that keys them last (so that a mutant may resize it); its ``.index``.

    Given ``data`` (a mutant data file), the index is written anew around it, as a hostile
    writer would: every CRC-32C, and the object graph's size, from what the mutant holds, so
    that mutants reach the graph's parse and the arrays rather than end at a checksum.
    """
    import ml_dtypes

    import tf_forge
    from weightstore.formats._sstable import crc32c
    from weightstore.formats.tf_checkpoint import OBJECT_GRAPH_KEY, VARIABLE_SUFFIX, slice_key

    variables = ["save_counter", "model/bias", "model/codes", "model/empty", "model/kernel", "model/vocab"]
    graph = _object_graph([(0, 1, "model"), *((1 if "/" in name else 0, node, name.split("/")[-1])
                                              for node, name in enumerate(variables, 2))], dict(enumerate(variables, 2)))
    entry = {name: (name + VARIABLE_SUFFIX).encode() for name in variables}
    kernel = np.arange(48, dtype=np.float32).reshape(6, 8)
    halves = [[(0, 3), (0, -1)], [(3, 3), (0, -1)]]
    regions = [  # index key, DataType number, shape, the bytes the seed stores
        (entry["model/bias"], 14, (8,), np.linspace(-1, 1, 8).astype(ml_dtypes.bfloat16).tobytes()),
        (entry["model/codes"], 6, (10,), np.arange(-5, 5, dtype=np.int8).tobytes()),
        (entry["model/empty"], 1, (0, 3), b""),
        *((slice_key(entry["model/kernel"], half), 1, (3, 8), kernel[half[0][0] :][:3].tobytes()) for half in halves),
        (entry["model/vocab"], tf_forge.DT_STRING, (3,), tf_forge.string_tensor([b"a", b"bc", b""])[0]),
        (entry["save_counter"], 9, (), np.int64(3).tobytes()),
        (OBJECT_GRAPH_KEY.encode(), tf_forge.DT_STRING, (), tf_forge.string_scalar(graph)[0]),
    ]
    if data is None:
        data = b"".join(seed for *_, seed in regions)
        (tree / "ckpt.data-00000-of-00001").write_bytes(data)
    items = [(b"", tf_forge.header()), (entry["model/kernel"], tf_forge.entry(shape=kernel.shape, slices=halves))]
    offset = 0
    for key, dtype, shape, seed in regions:
        size = _string_size(data, offset) if key == OBJECT_GRAPH_KEY.encode() else len(seed)
        stored = data[offset : offset + size]
        crc = _string_crc(stored, math.prod(shape)) if dtype == tf_forge.DT_STRING else crc32c(stored)
        items.append((key, tf_forge.entry(dtype=dtype, shape=shape, offset=offset, size=size, crc=crc)))
        offset += size
    (tree / "ckpt.index").write_bytes(tf_forge.table(sorted(items)))
    return tree / "ckpt.index"


def _string_size(data: bytes, offset: int) -> int:
    """The bytes of the one DT_STRING element at ``offset`` (varint length, its CRC, the bytes)
    by its length field; to the end of ``data`` where that is damaged or reaches past it."""
    from weightstore.formats._sstable import read_varint

    try:
        length, at = read_varint(data, offset, len(data), 64, path="mutant", what="a string length")
    except ws.WeightStoreError:
        return len(data) - offset
    return min(at - offset + 4 + length, len(data) - offset)


def _string_crc(stored: bytes, count: int) -> int:
    """The CRC-32C a bundle entry records for ``count`` DT_STRING elements (0 where their
    lengths do not parse): of each length as 4 bytes (8 past 4 GB), the lengths' CRC, the bytes."""
    from weightstore.formats._sstable import crc32c, read_varint

    crc, at = 0, 0
    for _ in range(count):
        try:
            length, at = read_varint(stored, at, len(stored), 64, path="mutant", what="a string length")
        except ws.WeightStoreError:
            return 0
        crc = crc32c(struct.pack("<I" if length <= 0xFFFFFFFF else "<Q", length), crc)
    return crc32c(stored[at + 4 :], crc32c(stored[at : at + 4], crc))


def _object_graph(edges: list[tuple[int, int, str]], variables: dict[int, str]) -> bytes:
    """A ``TrackableObjectGraph`` of these edges (parent, child, name) whose nodes ``variables``
    names hold the variable of that checkpoint entry name."""
    from weightstore.formats._tf_protos import TrackableObjectGraph
    from weightstore.formats.tf_checkpoint import VARIABLE_SUFFIX

    graph = TrackableObjectGraph()
    nodes = [graph.nodes.add() for _ in range(1 + max(child for _, child, _ in edges))]
    for parent, child, name in edges:
        nodes[parent].children.add(node_id=child, local_name=name)
    for node, name in variables.items():
        nodes[node].attributes.add(name="VARIABLE_VALUE", checkpoint_key=name + VARIABLE_SUFFIX)
    return graph.SerializeToString()


def sample_object_graph() -> bytes:
    """A TF2 object graph as Keras writes one: model -> layer -> kernel and bias, an optimizer
    with a step counter and a slot variable, a variable list."""
    from weightstore.formats._tf_protos import TrackableObjectGraph

    graph = TrackableObjectGraph()
    nodes = [graph.nodes.add() for _ in range(8)]
    for parent, child, name in [(0, 1, "model"), (1, 2, "dense_1"), (2, 3, "kernel"), (2, 4, "bias"),
                                (0, 5, "optimizer"), (5, 6, "iter"), (1, 7, "_variables"), (7, 3, "0")]:
        nodes[parent].children.add(node_id=child, local_name=name)
    for node, name in [(3, "model/dense_1/kernel"), (4, "model/dense_1/bias"), (6, "optimizer/iter")]:
        nodes[node].attributes.add(name="VARIABLE_VALUE", checkpoint_key=f"{name}/.ATTRIBUTES/VARIABLE_VALUE")
    nodes[5].slot_variables.add(original_variable_node_id=3, slot_name="m", slot_variable_node_id=6)
    return graph.SerializeToString()


def _read_object_graph(path: Path) -> object:
    from weightstore.formats.tf_checkpoint import natural_order, object_graph_keys, parse_object_graph

    keys = object_graph_keys(parse_object_graph(path.read_bytes()))
    return sorted(keys.values(), key=natural_order)


def _save_keras_archive(path: Path) -> None:
    """A ``.keras`` archive as Keras lays one out: metadata, config, then the weights file."""
    import io
    import zipfile

    import h5py

    weights = io.BytesIO()
    with h5py.File(weights, "w") as handle:
        handle["layers/dense/vars/0"] = np.arange(12, dtype=np.float32).reshape(3, 4)
        handle["layers/dense/vars/1"] = np.zeros(4, np.float32)
    config = {"module": "keras", "class_name": "Sequential", "config": {"name": "s", "layers": [
        {"class_name": "Dense", "config": {"name": "dense", "units": 4}}]}}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("metadata.json", '{"keras_version": "3.0.0"}')
        archive.writestr("config.json", json.dumps(config))
        archive.writestr("model.weights.h5", weights.getvalue())


def _read_keras_config(path: Path) -> object:
    from weightstore.formats.keras_file import read_config

    return read_config(path)


def _read_like_numpy(path: Path) -> object:
    """The npz fast path against ``np.load``: what both read must be the same arrays."""
    ours, _, _ = read_file(path)
    try:
        with np.load(path, allow_pickle=False) as theirs:
            numpy_arrays = {name: theirs[name] for name in theirs.files}
    except Exception:  # numpy refuses a file we read: a CRC it checks late, a name it mangles; ours is verified
        return ours
    for key, value in ours.items():
        other = numpy_arrays.get(key)
        if other is not None and (other.dtype != value.dtype or other.shape != value.shape
                                  or other.tobytes() != value.tobytes()):
            raise Finding(f"tensor {key!r} reads as {value.dtype} {value.shape} here, {other.dtype} {other.shape} "
                          "with np.load")
    return ours


def _write_mapping(path: Path) -> None:
    """Mapping rules as ``ws import --map`` takes them, one a line: scope rules and ``*/`` endings."""
    path.write_text("dense/kernel=dense/w\n*/ExponentialMovingAverage=*\n*/bias=*/b\nemb=\n")


def _remap_by_rules(path: Path) -> object:
    """The rules in the file (a line each) over keys they match and miss: renamed one key per
    key (an EMA shadow takes its raw key's name), or refused with InvalidKeyError/SelectionError."""
    from weightstore.core.keys import remap

    rules = [line for line in path.read_bytes().decode("utf-8", "surrogateescape").split("\n") if line]
    keys = ["dense/kernel", "dense/bias", "dense/kernel/ExponentialMovingAverage", "emb/x", "w", "w/bias"]
    renamed = remap({key: key for key in keys}, mapping=rules)
    if len(set(renamed.values())) != len(renamed):
        raise Finding(f"two keys became one: {renamed}")
    return renamed


def _publish(folder: Path) -> None:
    folder.mkdir()
    ws.publish(folder, {"w": np.arange(4, dtype=np.float32)}, step=7)


def _commit_shards(path: Path) -> None:
    """A sharded version of two ranks beside ``path``, and its index copied to ``path``: a mutant
    index written beside it names the same members (a piece held by each rank, one whole tensor)."""
    kernel = sample_weights()["dense/kernel"]
    for rank in range(2):
        held = {"dense/kernel": ws.Piece(kernel[3 * rank:3 * rank + 3], (3 * rank, 0), kernel.shape)}
        if rank:
            held |= {k: v for k, v in sample_weights().items() if k != "dense/kernel"}
        ws.publish_shard(path.parent, held, step=1, rank=rank, world=2, attempt=0)
    version = ws.commit_shards(path.parent, step=1, world=2, attempt=0, timeout=10)
    path.write_bytes(Path(version.path).read_bytes())


def _publish_deltas(folder: Path) -> None:
    """Versions 1 (npz), 2 and 3 (deltas) of ``folder``: between them tensors change in a few
    elements (sparse), all over (XOR + zstd; the second time, by a publisher that remembers the
    first, with the top plane apart: xor-top), not at all (same), or appear (raw)."""
    rng = np.random.default_rng(7)
    weights = sample_weights() | {"wide": np.arange(4000, dtype=np.float32),
                                  "moved": np.linspace(1, 2, 4000, dtype=np.float32)}
    delta = ws.Delta()
    for step in (1, 2, 3):
        if step > 1:
            weights = dict(weights)
            wide = weights["wide"].copy()
            wide[rng.choice(wide.size, 200, replace=False)] = rng.standard_normal(200)
            weights["wide"] = wide
            weights["dense/kernel"] = weights["dense/kernel"] * step
            weights["moved"] = weights["moved"] * np.float32(1.001)
            weights[f"new_{step}"] = np.arange(step, dtype=np.int64)
        ws.publish(folder, weights, step=step, delta=delta, metadata={"lr": 0.5})


def _two_ranks(folder: Path) -> None:
    """Two ranks' shards of step 1, not yet committed: a piece held by each rank, whole tensors."""
    kernel = sample_weights()["dense/kernel"]
    for rank in range(2):
        held = {"dense/kernel": ws.Piece(kernel[3 * rank:3 * rank + 3], (3 * rank, 0), kernel.shape)}
        if rank:
            held |= {k: v for k, v in sample_weights().items() if k != "dense/kernel"}
        ws.publish_shard(folder, held, step=1, rank=rank, world=2, attempt=0)


def _sharded_deltas(folder: Path) -> None:
    """Steps 1 (full members) and 2 (each rank's member a delta of its own of step 1), committed."""
    weights = sample_weights()
    for step in (1, 2):
        kernel = weights["dense/kernel"] * step
        for rank in range(2):
            held = {"dense/kernel": ws.Piece(kernel[3 * rank:3 * rank + 3], (3 * rank, 0), kernel.shape)}
            if rank:
                held |= {k: v for k, v in weights.items() if k != "dense/kernel"}
            ws.publish_shard(folder, held, step=step, rank=rank, world=2, attempt=0, delta=True)
        ws.commit_shards(folder, step=step, world=2, attempt=0, timeout=10)


def _committed(folder: Path) -> None:
    _two_ranks(folder)
    ws.commit_shards(folder, step=1, world=2, attempt=0, timeout=10)


def _commit_again(folder: Path) -> Path:
    """Commit step 1 from its done-records as they are now (the last commit undone)."""
    for name in ("LATEST", "step-000000000001.wsindex"):
        (folder / name).unlink(missing_ok=True)
    return Path(ws.commit_shards(folder, step=1, world=2, attempt=0, timeout=5).path)


def _cli(path: Path) -> None:
    """The ``ws`` verbs that read a version and its folder; what escapes them is raised (``--debug``)."""
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    for args in (["verify", path], ["ls", "--json", path], ["versions", "--json", path.parent]):
        result = CliRunner().invoke(app, ["--debug", *map(str, args)])
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception


def reframe(data: bytes) -> bytes:
    """A delta version's section sizes made anew from where its three JSON sections now end (as
    it is where they do not parse), so that a mutant's head, entries and manifest are parsed."""
    from weightstore.formats import delta

    if not data.startswith(delta.MAGIC):
        return data
    text, at, sizes = data.decode("latin-1"), delta._PREFIX.size, []  # latin-1: a character per byte
    for _ in range(3):
        try:
            end = json.JSONDecoder().raw_decode(text, at)[1]
        except ValueError:
            return data
        sizes.append(end - at)
        at = end
    return delta._PREFIX.pack(delta.MAGIC, *sizes) + data[delta._PREFIX.size:]


def reseal(data: bytes) -> bytes:
    """``data`` with its CRC-32 seal made anew (as it is where it has none)."""
    from weightstore.core.manifest import crc32

    at = data.rfind(b',"crc32":')
    if at < 0:
        return data
    return data[:at] + b',"crc32":%d}' % crc32(np.frombuffer(data[:at], np.uint8))


def reseal_table(data: bytes) -> bytes:
    """A TF checkpoint index with its magic number and the masked CRC-32C trailers of its index
    block and of the data blocks that index names made anew (where the footer and index still
    parse), so that a mutant reaches the block entries and BundleEntryProtos behind the checks."""
    import tf_forge
    from weightstore.formats import _sstable

    out = bytearray(data)
    if len(out) >= _sstable.FOOTER_BYTES:
        out[-8:] = _sstable.TABLE_MAGIC.to_bytes(8, "little")

    def seal(offset: int, size: int) -> None:
        if offset + size + _sstable.TRAILER_BYTES <= len(out) - _sstable.FOOTER_BYTES:
            crc = _sstable.crc32c(bytes(out[offset : offset + size + 1]))
            out[offset + size + 1 : offset + size + 5] = tf_forge.mask(crc).to_bytes(4, "little")

    try:
        offset, size = _sstable.Table(bytes(out), "mutant")._index
        seal(offset, size)  # first, or a mutant whose index block does not parse reaches nothing
        table = _sstable.Table(bytes(out), "mutant")
        for _, value in table._entries(offset, offset + size, "index block"):
            seal(*_sstable._handle(value, 0, len(value), "mutant", "index block")[0])
    except ws.WeightStoreError:
        pass  # what could be sealed is
    else:
        seal(offset, size)  # last: a data block's seal may have landed in the index block
    return bytes(out)


_ATTEMPT = "step-000000000001.attempt-0"
_INDEX = "step-000000000001.wsindex"


TARGETS = {
    "npz": Target("npz", ".npz", lambda p: ws.save(p, sample_weights(), metadata={"lr": 0.5})),
    "npz-many": Target("npz-many", ".npz", lambda p: ws.save(p, many_weights())),
    "npz-compressed": Target("npz-compressed", ".npz", lambda p: ws.save(p, sample_weights(), compress=True)),
    "hdf5": Target("hdf5", ".h5", lambda p: ws.save(p, sample_weights(), metadata={"lr": 0.5}, compress=True),
                   checks_metadata=False),
    "numpy-savez": Target("numpy-savez", ".npz", _save_plain_numpy),
    "latest": Target("latest", "", _publish),
    "safetensors": Target("safetensors", ".safetensors",
                          lambda p: ws.save(p, sample_weights(), metadata={"lr": 0.5})),
    # resealed (unsealed, nearly every mutant ended at a block's CRC-32C check): only an
    # escaped exception or a hang is a finding, as for a sharded index
    "tf-index": Target("tf-index", ".index", _save_checkpoint, fixup=reseal_table, reader=lambda path: read_file(path)),
    "tf-object-graph": Target("tf-object-graph", ".pb", lambda p: p.write_bytes(sample_object_graph()),
                              reader=_read_object_graph),
    "keras": Target("keras", ".keras", _save_keras_archive, checks_metadata=False),
    "keras-config": Target("keras-config", ".keras", _save_keras_archive, reader=_read_keras_config),
    "npz-numpy": Target("npz-numpy", ".npz", lambda p: ws.save(p, sample_weights()), reader=_read_like_numpy),
    # resealed, as a hostile writer would (unsealed, nearly every mutant ended at the CRC-32
    # check): what it then says (a key renamed) is the writer's word, so only an escaped
    # exception or a hang is a finding, as for a done-record
    "sharded-index": Target("sharded-index", ".wsindex", _commit_shards, fixup=reseal,
                            reader=lambda path: read_file(path)),
    "delta": Target("delta", ".wsdelta", _publish_deltas, mutated="step-000000000003.wsdelta", fixup=reframe),
    # a damaged base under an intact delta: what the top of the chain reads
    "delta-base": Target("delta-base", ".wsdelta", _publish_deltas, mutated="step-000000000002.wsdelta",
                         opened=lambda tree: tree / "step-000000000003.wsdelta"),
    "cli-delta": Target("cli-delta", ".wsdelta", _publish_deltas, mutated="step-000000000003.wsdelta",
                        fixup=reframe, reader=_cli),
    # resealed: what a rank wrote (a key left out, another dtype) is committed as it says
    "sharded-done": Target("sharded-done", ".done", _two_ranks, fixup=reseal, reader=lambda path: read_file(path),
                           mutated=f"{_ATTEMPT}/rank-00001.done", opened=_commit_again),
    "sharded-blocks": Target("sharded-blocks", ".blocks", _committed, checks_metadata=False,
                             mutated=f"{_ATTEMPT}/rank-00001.blocks", opened=lambda tree: tree / _INDEX),
    "sharded-member": Target("sharded-member", ".safetensors", _committed, checks_metadata=False,
                             mutated=f"{_ATTEMPT}/rank-00001.safetensors", opened=lambda tree: tree / _INDEX),
    "sharded-delta": Target("sharded-delta", ".wsdelta", _sharded_deltas, checks_metadata=False,
                            mutated="step-000000000002.attempt-0/rank-00001.wsdelta", fixup=reframe,
                            opened=lambda tree: tree / "step-000000000002.wsindex"),
    "hf-index": Target("hf-index", ".json", lambda p: ws.save(p, sample_weights(), max_shard_size=2000),
                       mutated="model.safetensors.index.json", opened=lambda tree: tree),
    "mapping": Target("mapping", ".map", _write_mapping, reader=_remap_by_rules),
    # resealed: the index is written anew around each mutant (its CRC-32Cs, the object graph's
    # size), so only an escaped exception or a hang is a finding, as for tf-index
    "tf-data": Target("tf-data", ".data-00000-of-00001", rich_checkpoint, reader=lambda path: read_file(path),
                      mutated="ckpt.data-00000-of-00001",
                      opened=lambda tree: rich_checkpoint(tree, (tree / "ckpt.data-00000-of-00001").read_bytes())),
}


class Finding(AssertionError):
    """A mutant broke the property; the message says how."""


def read_file(path: Path) -> tuple[dict[str, np.ndarray], dict, bool]:
    """Everything a user can read from a weight file, verified, in memory it owns; and
    whether a manifest said what it holds."""
    with ws.open(path, verify=True) as store:
        together = store.read()  # many tensors at once: npz checks them as columns
        arrays = {}
        for key in store:
            store.info(key)
            arrays[key] = np.array(store[key])
            if together[key].tobytes() != arrays[key].tobytes() or together[key].dtype != arrays[key].dtype:
                raise Finding(f"tensor {key!r} reads differently alone and with the others")
        return arrays, dict(store.metadata), store.has_checksums


def check_file(opened: Callable[[], Path], expected: tuple[dict[str, np.ndarray], dict, bool] | None,
               checks_metadata: bool) -> str:
    """Read a mutant (the file ``opened`` returns); ``"refused"`` or ``"same"``, else raise :class:`Finding`.

    ``expected`` is what the seed file reads as; a mutant that reads must read as exactly that
    (same keys, dtypes, shapes, bytes and, where the format checks its manifest, the same
    metadata), keys in the same order. The exception, ``"unverified"``: an HDF5 file whose
    manifest attribute was destroyed (its name damaged) is a plain HDF5 file, read as one
    (``Store.has_checksums`` is False), and format version 1 has nothing to tell the two apart;
    npz cannot get there (its manifest member is CRC-checked and named twice).
    """
    try:
        arrays, metadata, has_manifest = read_file(opened())
    except ws.WeightStoreError:
        return "refused"
    except Exception as exc:
        raise Finding(f"{type(exc).__name__} escaped: {exc}") from exc
    if expected is not None:
        want, want_metadata, seed_has_manifest = expected
        if seed_has_manifest and not has_manifest:
            return "unverified"  # an HDF5 file whose manifest attribute is gone is a plain HDF5 file
        order = list if has_manifest else sorted
        if order(arrays) != order(want):
            raise Finding(f"read keys {sorted(arrays)[:5]} instead of {sorted(want)[:5]}")
        for key, value in arrays.items():
            original = want[key]
            if value.dtype != original.dtype or value.shape != original.shape or value.tobytes() != original.tobytes():
                raise Finding(f"tensor {key!r} read as {value.dtype} {value.shape}, differing from the original")
        if checks_metadata and metadata != want_metadata:
            raise Finding(f"metadata read as {metadata!r} instead of {want_metadata!r}")
    return "same"


def check_latest(folder: Path) -> str:
    """``latest`` on a folder whose ``LATEST`` holds the mutant: a Version, None or a WeightStoreError."""
    try:
        version = ws.latest(folder)
    except ws.WeightStoreError:
        return "refused"
    except Exception as exc:
        raise Finding(f"{type(exc).__name__} escaped: {exc}") from exc
    if version is not None and not isinstance(version, ws.Version):
        raise Finding(f"latest returned {version!r}")
    return "same"


def check_reader(reader: Callable[[Path], object], opened: Callable[[], Path]) -> str:
    """A target's own reader on a mutant (the file ``opened`` returns): ``"refused"`` or ``"same"``,
    else :class:`Finding`."""
    try:
        reader(opened())
    except ws.WeightStoreError:
        return "refused"
    except Finding:
        raise
    except Exception as exc:
        raise Finding(f"{type(exc).__name__} escaped: {exc}") from exc
    return "same"


class Session:
    """A target's seed, made once in ``folder``, and the check of each mutant against it."""

    def __init__(self, target: Target, folder: Path):
        self.target = target
        if target.name == "latest":
            self.where = folder / "versions"
            target.make_seed(self.where)
            self.seed = (self.where / "LATEST").read_bytes()
            self.expected = None
        elif target.mutated is not None:
            self.where = folder / "tree"
            self.where.mkdir()
            target.make_seed(self.where)
            self.seed = (self.where / target.mutated).read_bytes()
            self.expected = None if target.reader else read_file(self._opened())
        else:
            self.where = folder
            self.seed = target.seed(folder)
            seed = folder / f"seed-{target.name}{target.suffix}"
            for companion in folder.glob(f"seed-{target.name}.*"):  # a checkpoint's data file stays beside it
                if companion != seed:
                    shutil.copyfile(companion, folder / ("mutant" + companion.name[len(f"seed-{target.name}"):]))
            self.expected = None if target.reader else read_file(seed)

    def check(self, data: bytes) -> str:
        """Write ``data`` where the target's file goes and check it; :class:`Finding` if it breaks the property."""
        if self.target.fixup is not None:
            data = self.target.fixup(data)
        if self.target.name == "latest":
            (self.where / "LATEST").write_bytes(data)
            return check_latest(self.where)
        if self.target.mutated is not None:
            mutant = self.where / self.target.mutated
            mutant.write_bytes(data)
            try:
                if self.target.reader is not None:
                    return check_reader(self.target.reader, self._opened)
                return check_file(self._opened, self.expected, self.target.checks_metadata)
            finally:
                mutant.write_bytes(self.seed)
        path = self.where / f"mutant{self.target.suffix}"
        path.write_bytes(data)
        try:
            if self.target.reader is not None:
                return check_reader(self.target.reader, lambda: path)
            return check_file(lambda: path, self.expected, self.target.checks_metadata)
        finally:
            os.unlink(path)

    def _opened(self) -> Path:
        """What a tree target reads: its mutated file, or what ``opened`` makes of the folder."""
        assert self.target.mutated is not None
        opened = self.target.opened
        return opened(self.where) if opened is not None else self.where / self.target.mutated


def fuzz_batch(name: str, seed: int, count: int, folder: Path, *, log=None) -> dict[str, int]:
    """``count`` seeded mutants of target ``name``; outcome -> how many.

    A mutant that breaks the property is kept as ``folder/finding-NAME-N`` and raised as a
    :class:`Finding` naming it; ``log`` (a text stream) gets a line before each mutant, so a
    process that dies on one leaves its number behind.
    """
    session = Session(TARGETS[name], folder)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for number in range(count):
        mutant = mutate(session.seed, rng)
        kept = folder / f"finding-{name}-{number}{session.target.suffix or '.latest'}"
        if log is not None:
            kept.write_bytes(mutant)
            print("START", number, kept, file=log, flush=True)
        try:
            outcome = session.check(mutant)
        except Finding as finding:
            kept.write_bytes(mutant)
            raise Finding(f"{name} mutant {number} (kept as {kept}): {finding}") from None
        if log is not None:
            kept.unlink()
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


# -- mutations -------------------------------------------------------------------------------

_INTERESTING = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, ord("0"), ord("9"), ord("{"), ord("[")]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to three of: bit flips, interesting bytes, truncation, insertion, deletion, splice."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        if not out:
            out += bytes([rng.randrange(256)])
            continue
        at = rng.randrange(len(out))
        kind = rng.choices(range(6), weights=(4, 3, 1, 1, 1, 1))[0]  # truncation alone ends most reads early
        if kind == 0:
            out[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            out[at] = rng.choice(_INTERESTING)
        elif kind == 2:
            del out[rng.randrange(len(out)) :]
        elif kind == 3:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == 4:
            del out[at : at + rng.randint(1, 64)]
        else:
            start = rng.randrange(len(out))
            chunk = bytes(out[start : start + rng.randint(1, 256)])
            out[at : at + len(chunk)] = chunk
    return bytes(out)
