"""Sharded versions at scale, by simulation: index bytes, and what one reader fetches, against
model size and rank count, beside PyTorch DCP's metadata for the same layout.

No tensor byte is written. For LLaMA-shaped models (7B, 13B, 70B, 405B: every layer's q, k, v,
o, gate, up, down and two norms, the embedding, the output and the final norm, bfloat16),
each rank of ``world`` holds FSDP2's piece of every tensor (``torch.chunk`` along its first
axis). With the library's own classes it builds what each rank would write (its block table,
:class:`~weightstore.formats._sharded_index.BlockTable`, cut as ``publish_shard`` cuts it, with
zero checksums; its :class:`~weightstore.formats._sharded_index.DoneRecord`), checks each
rank's share as ``publish_shard`` does, merges the done-records as ``commit_shards`` does,
writes the index and parses it back. Then one reader of ``1/world`` of the model in another
partitioning (of every tensor, the rows of one chunk moved by half a chunk, so that it cuts two
pieces of each) picks its boxes from the parsed index, parses the block tables of the members
that hold them, and counts the member bytes it would fetch (the reader's own arithmetic,
:class:`weightstore.formats.sharded._PieceRead`) and the index bytes (the index, those
tables' headers and the pages of CRC-32s of the blocks it reads), and the most memory the
index, the tables and the reader's picking take at once (``tracemalloc``).

DCP: ``torch.distributed.checkpoint.metadata.Metadata`` for the same tensors and chunks, as
``DefaultSavePlanner`` and ``FileSystemWriter`` fill it (one ``ChunkStorageMetadata`` per
piece; ``storage_data``: a ``MetadataIndex`` -> ``_StorageInfo`` per piece; ``planner_data``:
each key's path), pickled: the ``.metadata`` file every DCP reader loads whole.

    python -m benchmarks.shard_index_bench                      # 7B..405B at 8, 64, 1000 ranks
    python -m benchmarks.shard_index_bench --models 405B --worlds 1000
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from benchmarks.common import MB, fmt_ratio, machine_line, table
from weightstore.core import limits
from weightstore.formats import _sharded_index as shardindex
from weightstore.formats._sharded_index import (
    BlockTable,
    Box,
    DoneRecord,
    DoneTensor,
    Member,
    Placed,
    ShardIndex,
    member_name,
    piece_cut,
    tile_bytes,
)
from weightstore.formats.sharded import _PieceRead, blocks_in
from weightstore.sharded import _shards as shards


@dataclass(frozen=True)
class Shape:
    """A LLaMA-style model: layers, hidden, FFN, vocabulary, attention heads and KV heads."""

    layers: int
    hidden: int
    ffn: int
    vocab: int
    heads: int
    kv_heads: int

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        kv = self.kv_heads * (self.hidden // self.heads)
        yield "tok_embeddings/weight", (self.vocab, self.hidden)
        for i in range(self.layers):
            at = f"layers/{i}"
            yield f"{at}/attention/wq/weight", (self.hidden, self.hidden)
            yield f"{at}/attention/wk/weight", (kv, self.hidden)
            yield f"{at}/attention/wv/weight", (kv, self.hidden)
            yield f"{at}/attention/wo/weight", (self.hidden, self.hidden)
            yield f"{at}/feed_forward/w1/weight", (self.ffn, self.hidden)
            yield f"{at}/feed_forward/w2/weight", (self.hidden, self.ffn)
            yield f"{at}/feed_forward/w3/weight", (self.ffn, self.hidden)
            yield f"{at}/attention_norm/weight", (self.hidden,)
            yield f"{at}/ffn_norm/weight", (self.hidden,)
        yield "norm/weight", (self.hidden,)
        yield "output/weight", (self.vocab, self.hidden)


MODELS = {
    "7B": Shape(32, 4096, 11008, 32000, 32, 32),
    "13B": Shape(40, 5120, 13824, 32000, 40, 40),
    "70B": Shape(80, 8192, 28672, 32000, 64, 8),
    "405B": Shape(126, 16384, 53248, 128256, 128, 8),
}
DTYPE, ITEMSIZE = "bfloat16", 2
STEP, ATTEMPT = 1, 0
#: a safetensors member's header, about (the offsets only need to be plausible)
HEADER = 64 << 10


def chunk(rows: int, rank: int, world: int) -> tuple[int, int]:
    size = -(-rows // world)
    return min(rows, rank * size), min(rows, (rank + 1) * size)


def rank_files(shape: Shape, rank: int, world: int) -> tuple[DoneRecord, BlockTable, bytes, int]:
    """What ``rank`` would write: its done-record, its block table (zero checksums), the table's
    head, and the bytes its share of the index may take (what ``publish_shard`` checks)."""
    placed, tensors, blocks, offset = [], {}, 0, HEADER
    held = [(key, full, *chunk(full[0], rank, world)) for key, full in shape.tensors()]
    tile = tile_bytes(sum((hi - lo) * math.prod(full[1:]) * ITEMSIZE for _, full, lo, hi in held))
    for key, full, lo, hi in held:
        if hi <= lo:
            continue
        start, piece = (lo,) + (0,) * (len(full) - 1), (hi - lo, *full[1:])
        columns, rows = piece_cut(piece, ITEMSIZE, tile)
        strips = -(-piece[1] // columns) if columns else 1
        entry = Placed(key, DTYPE, start, piece, columns, rows, blocks, ())
        offsets = []
        for strip in range(strips):
            offsets.append(offset)
            offset += entry.strip_bytes(strip)
        placed.append(Placed(key, DTYPE, start, piece, columns, rows, blocks, tuple(offsets)))
        blocks += strips * entry.blocks_per_strip
        tensors[key] = DoneTensor(DTYPE, full, ((start, piece, "blake3:" + "0" * 64),))
    name = member_name(rank)
    crcs = np.zeros(blocks, np.uint32)
    table = BlockTable(step=STEP, attempt=ATTEMPT, rank=rank, member=name, size=offset, pieces=placed, crcs=crcs,
                       digests=None, digests_blake3="0" * 64)
    head, ref = table.head_bytes(), table.ref()
    boxes = [Box(rank, p.start, p.shape) for p in placed]
    shardindex.check_share(world=world, keys={k: (t.dtype, t.shape) for k, t in tensors.items()}, boxes=boxes,
                           member=(name, offset, ref), where=name)
    share = shardindex.member_entry_bytes(name, offset, ref) + shardindex.share_bytes(boxes, world)
    return DoneRecord(STEP, ATTEMPT, rank, world, Member(name, offset, rank, ref), tensors), table, head, share


def dcp_metadata_bytes(shape: Shape, world: int) -> int:
    """Bytes of DCP's pickled ``Metadata`` for the same tensors and chunks."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state, storage, planner = {}, {}, {}
    offsets = [0] * world
    for key, full in shape.tensors():
        fqn = key.replace("/", ".")
        chunks = []
        for rank in range(world):
            lo, hi = chunk(full[0], rank, world)
            if hi <= lo:
                continue
            start, piece = (lo,) + (0,) * (len(full) - 1), (hi - lo, *full[1:])
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(start), sizes=torch.Size(piece)))
            length = math.prod(piece) * ITEMSIZE
            storage[MetadataIndex(fqn, start)] = _StorageInfo(f"__{rank}_0.distcp", offsets[rank], length)
            offsets[rank] += length
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size(full), chunks)
        planner[fqn] = (fqn,)
    metadata = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage)
    return len(pickle.dumps(metadata))


def measure(name: str, shape: Shape, world: int, dcp: bool) -> list[str]:
    started = time.perf_counter()
    records, heads, done_bytes, table_bytes, crc_bytes, share_bytes = [], {}, 0, 0, 0, 0
    reader = world // 2
    wanted = set()  # the members the reader's rows may touch: reader's and its neighbours, kept whole
    for rank in range(world):
        record, table, head, share = rank_files(shape, rank, world)
        crc_bytes = max(crc_bytes, 4 * len(table.crcs))
        share_bytes = max(share_bytes, share)
        done_bytes = max(done_bytes, len(record.to_json()))
        table_bytes = max(table_bytes, len(head))
        records.append(record)
        if abs(rank - reader) <= 1:
            heads[rank] = head
            wanted.add(rank)
    index = shards._merged(records, STEP, ATTEMPT, world, {})
    index.created = "2026-01-01T00:00:00.000Z"
    data = index.to_json()
    parsed = ShardIndex.parse(data)
    nbytes = sum(math.prod(full) * ITEMSIZE for _, full in shape.tensors())
    parsed_tables: dict[int, BlockTable] = {}
    readers = {shift: read(parsed, parsed_tables, heads, reader, world, shift, wanted, len(data))
               for shift in (0, 1)}
    tracemalloc.start()  # what the shifted reader holds for the index: parsed, with its tables' heads and pages
    read(ShardIndex.parse(data), {}, heads, reader, world, 1, wanted, len(data))
    memory = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    seconds = time.perf_counter() - started
    bound = (limits.MAX_INDEX_BYTES - limits.KEY_BYTES - limits.RESERVED_BYTES) // world
    row = [name, f"{world:,}", f"{nbytes / 1e9:,.0f} GB", f"{len(data) / MB:,.2f} MB", f"{done_bytes / 1024:,.0f} KiB",
           f"{table_bytes / 1024:,.0f} KiB", f"{crc_bytes / 1024:,.0f} KiB", f"{share_bytes / bound:.0%}", f"{readers[0][3] / MB:,.0f} MB"]
    for shift in (0, 1):
        fetched, share, index_fetched, _ = readers[shift]
        row += [f"{index_fetched / MB:,.2f} MB", fmt_ratio(fetched / share)]
    row.append(f"{memory / MB:,.1f} MB")
    if dcp:
        dcp_bytes = dcp_metadata_bytes(shape, world)
        row += [f"{dcp_bytes / MB:,.2f} MB", fmt_ratio(dcp_bytes / len(data)), fmt_ratio(dcp_bytes / readers[1][2])]
    print(f"{name} at {world} ranks: {seconds:.0f} s", file=sys.stderr, flush=True)
    return [*row, f"{seconds:.0f}"]


def read(parsed: ShardIndex, tables: dict[int, BlockTable], heads: dict[int, bytes], reader: int, world: int,
         shift: int, wanted: set[int], index_bytes: int) -> tuple[int, int, int, int]:
    """What one reader of ``1/world`` fetches: of every tensor, the rows of chunk ``reader``
    (``shift``: moved by half a chunk, so it cuts two writers' pieces). Returns member bytes
    fetched, its share, index bytes fetched (the index and the heads of the tables it reads) and
    its share again."""
    fetched, share, wanted_blocks = 0, 0, {}
    for key, entry in parsed.tensors.items():
        rows = entry.shape[0]
        size = -(-rows // world)
        lo = min(rows, reader * size + shift * (size // 2))
        bounds = [(lo, min(rows, lo + size)), *((0, n) for n in entry.shape[1:])]
        if bounds[0][1] <= bounds[0][0]:
            continue
        share += math.prod(hi - lo for lo, hi in bounds) * ITEMSIZE
        assert entry.layout is not None
        for box in entry.layout.boxes_in(bounds):
            if box.member not in wanted:
                raise AssertionError(f"{key}: the reader touches member {box.member}, not built")
            table = tables.get(box.member)
            if table is None:
                member = parsed.members[box.member]
                assert member.table is not None
                table = tables[box.member] = BlockTable.parse_head(heads[box.member], member.table, member, STEP,
                                                                   ATTEMPT)
            placed = table.find(key, box.start)
            assert placed is not None
            wanted_blocks.setdefault(box.member, []).extend(blocks_in(placed, entry, bounds))
            for piece in table.placed(placed, box.member):
                found = _PieceRead.of(piece, entry, bounds)
                fetched += found.nbytes if found is not None else 0
    pages = sum(tables[m].page_span(first, count, len(heads[m]))[1] for m, blocks in wanted_blocks.items()
                for first, count in tables[m].pages_of(np.array(blocks, np.int64)))
    return fetched, share, index_bytes + sum(len(heads[m]) for m in wanted_blocks) + pages, share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--worlds", nargs="*", type=int, default=[8, 64, 1000])
    parser.add_argument("--no-dcp", action="store_true", help="skip DCP's metadata (needs torch)")
    args = parser.parse_args()
    print(f"## Sharded index at scale, simulated ({machine_line()})\n")
    print(f"Bounds: index <= {limits.MAX_INDEX_BYTES / MB:,.0f} MB; each rank's share of it "
          f"<= ({limits.MAX_INDEX_BYTES - limits.KEY_BYTES - limits.RESERVED_BYTES:,} / world) bytes, "
          f"its keys <= {limits.KEY_BYTES / MB:,.0f} MB.\n")
    headers = ["model", "ranks", "model bytes", "index", "done-record (max)", "table header (max)", "table CRC-32s",
               "rank share / bound (max)", "reader share",
               "aligned: index fetched", "fetched / share", "shifted: index fetched", "fetched / share", "shifted: index memory (peak)"]
    if not args.no_dcp:
        headers += ["DCP .metadata", "DCP / index", "DCP / shifted fetched"]
    rows = [measure(name, MODELS[name], world, not args.no_dcp) for name in args.models for world in args.worlds]
    print(table([*headers, "s"], rows))


if __name__ == "__main__":
    main()
