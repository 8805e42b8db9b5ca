"""What a sharded index costs to parse, per KB: a real one against hostile ones.

A real index is committed by ``ws.publish_shard`` and ``ws.commit_shards`` (``--world`` ranks,
``--keys`` tensors split by rows); the hostile ones are sealed by hand: "staircase" tilings
(row ``i`` from the diagonal right, column ``i`` below it), whose pieces overlap most others'
extents along both axes, in 2-D and in 3-D (three split axes: compared pairwise, within the
budget of ``OVERLAP_PAIRS`` / ``OVERLAP_PAIRS_PER_BYTE``), and many one-piece keys. Each is
parsed by ``ShardIndex.parse`` (what ``ws.open`` of a ``.wsindex`` does before touching a
member), best of ``--repeat``.

    python -m benchmarks.index_parse_bench
    python -m benchmarks.index_parse_bench --stairs 8192 --copies 4    # the 11.6 MB case
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import weightstore as ws
from benchmarks.common import table
from weightstore.errors import WeightStoreError
from weightstore.formats._sharded_index import ShardIndex, seal

Boxes = list[tuple[list[int], list[int]]]


def staircase(n: int, depth: int = 1) -> Boxes:
    """(start, shape) of pieces tiling an n x n (x depth) tensor as a staircase."""
    layers = [[z] for z in range(depth)] if depth > 1 else [[]]
    boxes: Boxes = []
    for z in layers:
        boxes += [([i, i, *z], [1, n - i, *[1] * len(z)]) for i in range(n)]
        boxes += [([i + 1, i, *z], [n - i - 1, 1, *[1] * len(z)]) for i in range(n - 1)]
    return boxes


def index_of(keys: dict[str, tuple[list[int], Boxes]]) -> bytes:
    """A sealed index of two members holding ``keys`` (key -> (shape, boxes)), one float32 piece a box."""
    members = [{"file": f"step-000000000001.attempt-0/rank-0000{r}.safetensors", "size": 1 << 40, "rank": r}
               for r in range(2)]
    tensors, offset = {}, 0
    for key, (shape, boxes) in keys.items():
        pieces = []
        for start, box in boxes:
            pieces.append({"member": 0, "start": start, "shape": box, "offset": offset, "rows": 1 << 20, "crcs": [0],
                           "digest": "blake3:" + "0" * 64})
            offset += int(np.prod(box)) * 4
        tensors[key] = {"dtype": "float32", "shape": shape, "pieces": pieces}
    return seal({"format": "weightstore-sharded", "version": 1, "step": 1, "attempt": 0, "world": 2, "created": "",
                 "producer": "", "metadata": {}, "members": members, "tensors": tensors})


def real_index(world: int, keys: int) -> bytes:
    rng = np.random.default_rng(5)
    model = {f"layer_{i}/kernel": rng.standard_normal((2 * world, 4)).astype(np.float32) for i in range(keys)}
    with tempfile.TemporaryDirectory() as folder:
        for rank in range(world):
            ws.publish_shard(folder, {key: ws.Piece(value[2 * rank:2 * rank + 2], (2 * rank, 0), value.shape)
                                      for key, value in model.items()}, step=1, rank=rank, world=world, attempt=0)
        return Path(ws.commit_shards(folder, step=1, world=world, attempt=0, timeout=600).path).read_bytes()


def parse_seconds(data: bytes, repeat: int) -> tuple[float, str]:
    best, outcome = float("inf"), "parsed"
    for _ in range(repeat):
        began = time.perf_counter()
        try:
            ShardIndex.parse(data)
        except WeightStoreError as exc:
            outcome = f"refused ({exc.message[:40]}...)"
        best = min(best, time.perf_counter() - began)
    return best, outcome


def bench(world: int, keys: int, stairs: int, copies: int, repeat: int) -> None:
    cases = {
        f"real: {world} ranks, {keys} keys": real_index(world, keys),
        f"{copies} x 2-D staircase of {stairs}": index_of({f"k{k}": ([stairs, stairs], staircase(stairs))
                                                          for k in range(copies)}),
        "3-D staircase of 2048 (under the pairs floor)": index_of({"k": ([2048, 2048, 2], staircase(2048, 2))}),
        f"{copies} x 3-D staircase of 4096 (past the budget)": index_of(
            {f"k{k}": ([4096, 4096, 2], staircase(4096, 2)) for k in range(copies)}),
        "20,000 one-piece keys": index_of({f"k{k}": ([1], [([0], [1])]) for k in range(20_000)}),
    }
    rows = []
    for what, data in cases.items():
        seconds, outcome = parse_seconds(data, repeat)
        rows.append([what, f"{len(data) / 1e6:.2f}", f"{seconds:.3f}", f"{seconds * 1e3 / (len(data) / 1024):.3f}",
                     outcome])
    print(table(["index", "MB", "seconds", "ms per KB", "outcome"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--keys", type=int, default=1500)
    parser.add_argument("--stairs", type=int, default=8192)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    bench(args.world, args.keys, args.stairs, args.copies, args.repeat)


if __name__ == "__main__":
    main()
