"""Hand-made TensorFlow checkpoints (tensor bundles) for the hostile-index tests.

Built byte by byte rather than with TensorFlow, because a hostile checkpoint is exactly one
TensorFlow would never write: overlapping tensors, lying sizes, duplicate names, bad varints.
Every field can be overridden; by default the result is a valid one-shard checkpoint that
both TensorFlow and weightstore read.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import crc32c
import numpy as np

from weightstore.formats._sstable import TABLE_MAGIC
from weightstore.formats._tf_protos import BundleEntryProto, BundleHeaderProto

DT_FLOAT, DT_STRING = 1, 7


def mask(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def entry(*, dtype: int = DT_FLOAT, shape: Sequence[int] = (), offset: int = 0, size: int = 0, crc: int = 0,
          shard: int = 0, slices: Sequence[Sequence[tuple[int, int]]] = ()) -> bytes:
    """A ``BundleEntryProto``; each slice is ``(start, length)`` per dimension, length -1 for all of it."""
    proto = BundleEntryProto(dtype=dtype, shard_id=shard, offset=offset, size=size, crc32c=mask(crc))
    for dim in shape:
        proto.shape.dim.add(size=dim)
    for extents in slices:
        piece = proto.slices.add()
        for start, length in extents:
            extent = piece.extent.add(start=start)
            if length >= 0:
                extent.length = length
    return proto.SerializeToString()


def header(num_shards: int = 1, endianness: int = 0) -> bytes:
    return BundleHeaderProto(num_shards=num_shards, endianness=endianness).SerializeToString()


def block(items: Sequence[tuple[bytes, bytes]], *, raw_entries: bytes | None = None) -> bytes:
    """A table block: entries without shared prefixes, one restart point."""
    body = raw_entries if raw_entries is not None else b"".join(
        varint(0) + varint(len(key)) + varint(len(value)) + key + value for key, value in items)
    return body + struct.pack("<II", 0, 1)


def trailed(contents: bytes, *, kind: int = 0, crc_delta: int = 0) -> bytes:
    return contents + bytes([kind]) + struct.pack("<I", (mask(crc32c.crc32c(contents + bytes([kind]))) + crc_delta)
                                                   & 0xFFFFFFFF)


def table(items: Sequence[tuple[bytes, bytes]], *, data_block: bytes | None = None, index_handle: tuple | None = None,
          data_handle: tuple | None = None, kind: int = 0, crc_delta: int = 0) -> bytes:
    """An SSTable of one data block; any part can be replaced to make it lie."""
    data = data_block if data_block is not None else block(items)
    out = trailed(data, kind=kind, crc_delta=crc_delta)
    handle = data_handle or (0, len(data))
    last_key = items[-1][0] if items else b""
    index = block([(last_key + b"\xff", varint(handle[0]) + varint(handle[1]))])
    index_at = len(out)
    out += trailed(index)
    metaindex_at = len(out)
    out += trailed(block([]))
    index_handle = index_handle or (index_at, len(index))
    footer = varint(metaindex_at) + varint(len(block([]))) + varint(index_handle[0]) + varint(index_handle[1])
    return out + footer.ljust(40, b"\0") + struct.pack("<Q", TABLE_MAGIC)


def write(prefix: Path, tensors: dict[str, np.ndarray], *, shards: int = 1, overrides: dict | None = None,
          extra: Sequence[tuple[bytes, bytes]] = ()) -> str:
    """A valid one-shard float checkpoint of ``tensors``; ``overrides[name]`` replaces entry fields."""
    data = b""
    items = [(b"", header(shards))]
    for name, array in sorted(tensors.items()):
        raw = np.ascontiguousarray(array, "<f4").tobytes()
        fields = {"shape": array.shape, "offset": len(data), "size": len(raw), "crc": crc32c.crc32c(raw)}
        fields.update((overrides or {}).get(name, {}))
        items.append((name.encode("utf-8"), entry(**fields)))
        data += raw
    items = sorted(items + list(extra), key=lambda item: item[0])
    Path(f"{prefix}.index").write_bytes(table(items))
    Path(f"{prefix}.data-00000-of-{shards:05d}").write_bytes(data)
    return str(prefix)


def shared_prefix_index(prefix: Path, count: int) -> str:
    """A checkpoint whose index holds ``count`` entries of 4 bytes, each key the one before it
    plus a byte: ``count`` squared over two bytes of keys rebuilt from a table of ``4 * count``."""
    body = bytearray(varint(0) + varint(0) + varint(len(header())) + header())
    for length in range(count):
        body += varint(length) + varint(1) + varint(0) + b"a"
    Path(f"{prefix}.index").write_bytes(table([(b"a" * count, b"")], data_block=block([], raw_entries=bytes(body))))
    Path(f"{prefix}.data-00000-of-00001").write_bytes(b"")
    return str(prefix)


def string_tensor(values: Sequence[bytes]) -> tuple[bytes, int]:
    """DT_STRING elements as a tensor bundle stores them (each one's varint length, the masked
    CRC-32C of the lengths, the bytes), and the CRC-32C of all that the entry records."""
    widths = b"".join(struct.pack("<I", len(value)) for value in values)
    masked = struct.pack("<I", mask(crc32c.crc32c(widths)))
    stored = b"".join(varint(len(value)) for value in values) + masked + b"".join(values)
    return stored, crc32c.crc32c(b"".join(values), crc32c.crc32c(masked, crc32c.crc32c(widths)))


def string_scalar(data: bytes) -> tuple[bytes, int]:
    """One DT_STRING element as a tensor bundle stores it, and the CRC-32C its entry records."""
    return string_tensor([data])


def with_object_graph(prefix: Path, graph: bytes, tensors: dict[str, np.ndarray] | None = None) -> str:
    """A TF2 object-based checkpoint whose ``_CHECKPOINTABLE_OBJECT_GRAPH`` is ``graph`` (any
    bytes), holding float ``tensors`` under their entry names after it."""
    stored, crc = string_scalar(graph)
    data, items = stored, [(b"", header()),
                           (b"_CHECKPOINTABLE_OBJECT_GRAPH", entry(dtype=DT_STRING, size=len(stored), crc=crc))]
    for name, array in sorted((tensors or {}).items()):
        raw = np.ascontiguousarray(array, "<f4").tobytes()
        items.append((name.encode("utf-8"), entry(shape=array.shape, offset=len(data), size=len(raw),
                                                  crc=crc32c.crc32c(raw))))
        data += raw
    Path(f"{prefix}.index").write_bytes(table(sorted(items)))
    Path(f"{prefix}.data-00000-of-00001").write_bytes(data)
    return str(prefix)


def chain_graph(count: int) -> bytes:
    """A ``TrackableObjectGraph`` of ``count`` nodes in one chain of edges named ``a``: paths
    ``count`` squared over two segments long in all."""
    from weightstore.formats._tf_protos import TrackableObjectGraph

    graph = TrackableObjectGraph()
    for number in range(count):
        node = graph.nodes.add()
        if number + 1 < count:
            node.children.add(node_id=number + 1, local_name="a")
    return graph.SerializeToString()
