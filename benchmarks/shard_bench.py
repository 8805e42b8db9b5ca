"""Sharded versions: what a commit costs, what each reader fetches, how writers scale.

Four tables, one run:

1. *Commit cost vs model size* (moto S3 on 127.0.0.1, counted at the server): the requests and
   bytes of ``commit_shards`` alone, after four ranks have written, for models of 1/4, 1/2 and
   all of ``--size-mb``. The coordinator reads only the done-records, so its bytes grow with
   the number of blocks (one CRC per 256 KiB), not with the tensor bytes.
2. *Bytes each reader fetches vs its share* (same server): a version written by 4 ranks by
   rows, read by 3 readers by rows, by 2 and by 3 by columns, a quarter (a 2x2 grid's cell)
   and whole; member bytes fetched over the bytes of the region, plus the index.
3. *Bytes a follower fetches per version* (same server): a torch module following versions
   written by 4 ranks, when one of ten tensors (10% of the model) changed; the block digests
   in the index say which tensors are unchanged, so it fetches the changed tensor and the index.
4. *A rank's save and read against ``torch.distributed.checkpoint``* (local folder, one process
   as rank 1 of 4, its own rows of every tensor in memory it owns, as an FSDP rank holds them):
   ``publish_shard`` against ``dcp.save`` (both durable: DCP fsyncs its files), with and
   without block digests (``digests=False``: a checkpoint no follower reads), then the rank's
   rows read back by ``read_region`` from the committed version against ``dcp.load`` into
   tensors of its share; rounds taken in turn, medians of wall and of this process's CPU
   seconds (every thread), per GB of the share, and the median of each round's ratio.
   ``--busy`` spins a CPU-bound neighbour beside them (:func:`benchmarks.common.busy_neighbour`).
5. *Write throughput for 1, 2, 4 writers* (local folder, forked processes started together):
   the model's bytes over the time from the first writer's start to the last one's end.
   Each writer is CPU-bound (the strips' copy, a CRC-32 per block, a CRC-64 per band of rows, the write); on a
   2-core machine 4 writers share 2 cores, so aggregate throughput stops growing at 2 writers.
   The per-writer figure is what scales with hosts: each host writes its own member, and the
   coordinator's work does not grow with the tensor bytes.

    python -m benchmarks.shard_bench --size-mb 64
    python -m benchmarks.shard_bench --vs-dcp --size-mb 1024 [--busy]   # table 4 alone
    python -m benchmarks.shard_bench --phases --size-mb 1024            # where table 4's save goes
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
import uuid
from typing import Any

import numpy as np

import weightstore as ws
from benchmarks.common import MB, busy_neighbour, fmt_ratio, machine_line, median, table
from benchmarks.s3_server import CountingS3, restore_environment, use_environment

BUCKET = "weightstore-shard-bench"
COLS = 4096
TENSORS = 8


def _model(size_mb: float) -> dict[str, np.ndarray]:
    rows = max(12, int(size_mb * MB / 4 / COLS / TENSORS) // 12 * 12)
    rng = np.random.default_rng(0)
    return {f"layer_{i}/kernel": rng.standard_normal((rows, COLS), dtype=np.float32) for i in range(TENSORS)}


def _pieces(model: dict[str, np.ndarray], rank: int, world: int) -> dict[str, ws.Piece]:
    held = {}
    for key, value in model.items():
        rows = value.shape[0] // world
        held[key] = ws.Piece(value[rank * rows:(rank + 1) * rows], (rank * rows, 0), value.shape)
    return held


def _write(folder: str, model: dict[str, np.ndarray], world: int, step: int) -> None:
    for rank in range(world):
        ws.publish_shard(folder, _pieces(model, rank, world), step=step, rank=rank, world=world, attempt=0)


def commit_cost(server: CountingS3, size_mb: float) -> str:
    rows = []
    for fraction in (0.25, 0.5, 1.0):
        model = _model(size_mb * fraction)
        folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        _write(folder, model, 4, step=1)
        server.reset()
        started = time.perf_counter()
        version = ws.commit_shards(folder, step=1, world=4, attempt=0, timeout=60)
        seconds = time.perf_counter() - started
        index = next(r.received for r in server.requests if r.method == "PUT" and r.path.endswith(".wsindex"))
        nbytes = sum(v.nbytes for v in model.values())
        rows.append([f"{nbytes / MB:,.0f} MB", str(server.count()), f"{server.bytes_sent() / 1024:,.1f} KiB",
                     f"{server.bytes_received() / 1024:,.1f} KiB", f"{index / 1024:,.1f} KiB", f"{seconds:.2f}"])
        assert ws.latest(folder).step == version.step
    return table(["model", "requests", "bytes read", "bytes written", "of which index", "s"], rows)


def reader_bytes(server: CountingS3, size_mb: float) -> str:
    model = _model(size_mb)
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    _write(folder, model, 4, step=1)
    version = ws.commit_shards(folder, step=1, world=4, attempt=0, timeout=60)
    total_rows = next(iter(model.values())).shape[0]
    readers: list[tuple[str, tuple[slice, ...]]] = [
        *((f"rows {i + 1}/3", (slice(i * total_rows // 3, (i + 1) * total_rows // 3),)) for i in range(3)),
        *((f"columns {i + 1}/2", (slice(None), slice(i * COLS // 2, (i + 1) * COLS // 2))) for i in range(2)),
        *((f"columns {i + 1}/3", (slice(None), slice(i * COLS // 3, (i + 1) * COLS // 3))) for i in range(3)),
        ("rows 1/2, columns 2/2", (slice(0, total_rows // 2), slice(COLS // 2, COLS))),
        ("whole", ()),
    ]
    rows = []
    for name, region in readers:
        server.reset()
        share = 0
        with ws.open(version) as store:
            for key, value in model.items():
                part = store.read_region(key, region)
                assert part.tobytes() == value[region].tobytes(), (name, key)
                share += part.nbytes
        members = sum(r.sent for r in server.requests if "rank-" in r.path)
        index = sum(r.sent for r in server.requests if r.path.endswith(".wsindex"))
        rows.append([name, f"{share / MB:,.1f} MB", f"{members / MB:,.1f} MB", fmt_ratio(members / share),
                     f"{index / 1024:,.1f} KiB", str(server.count())])
    return table(["reader", "its share", "member and table bytes fetched", "fetched/share", "index", "requests"], rows)


def other_worlds(server: CountingS3, size_mb: float) -> str:
    """Readers of another partitioning (thirds of the rows, thirds of the columns) of versions
    written by 2, 4, 8 and 16 ranks by rows: the worst of the three readers' member bytes
    (members and their tables' pages, counted at the server) over their share."""
    model = _model(size_mb)
    total_rows = next(iter(model.values())).shape[0]
    rows = []
    for world in (2, 4, 8, 16):
        folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        _write(folder, model, world, step=1)
        version = ws.commit_shards(folder, step=1, world=world, attempt=0, timeout=60)
        row = [str(world)]
        for cut in ("rows", "columns"):
            worst, tables = 0.0, 0
            for i in range(3):
                size = total_rows if cut == "rows" else COLS
                part = slice(i * size // 3, (i + 1) * size // 3)
                region = (part,) if cut == "rows" else (slice(None), part)
                server.reset()
                share = 0
                with ws.open(version) as store:
                    for key, value in model.items():
                        found = store.read_region(key, region)
                        assert found.tobytes() == value[region].tobytes(), (world, cut, i, key)
                        share += found.nbytes
                worst = max(worst, sum(r.sent for r in server.requests if "rank-" in r.path) / share)
                tables = max(tables, sum(r.sent for r in server.requests if r.path.endswith(".blocks")))
            row += [fmt_ratio(worst), f"{tables / 1024:,.1f} KiB"]
        rows.append(row)
    return table(["writers", "rows 1/3..3/3: fetched/share (worst)", "of it tables", "columns 1/3..3/3 (worst)",
                  "of it tables"], rows)


def follower_bytes(server: CountingS3, size_mb: float) -> str:
    import torch

    from weightstore.adapters import torch as torch_adapter

    rows = max(4, int(size_mb * MB / 4 / COLS / 10) // 4 * 4)
    rng = np.random.default_rng(1)
    model = {f"layer_{i}": rng.standard_normal((rows, COLS), dtype=np.float32) for i in range(10)}
    module = torch.nn.ParameterDict({key: torch.nn.Parameter(torch.zeros(value.shape)) for key, value in model.items()})
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    nbytes = sum(v.nbytes for v in model.values())
    table_rows = []
    for step in (1, 2, 3):
        if step > 1:
            model[f"layer_{step}"] = model[f"layer_{step}"] + 1  # one tensor of ten changes
        _write(folder, model, 4, step=step)
        version = ws.commit_shards(folder, step=step, world=4, attempt=0, timeout=60)
        server.reset()
        report = torch_adapter.assign(module, version)
        members = sum(r.sent for r in server.requests if "rank-" in r.path)
        index = sum(r.sent for r in server.requests if r.path.endswith(".wsindex"))
        table_rows.append([str(step), f"{len(report.assigned)} of 10", f"{members / MB:,.1f} MB",
                           fmt_ratio(members / nbytes), f"{index / 1024:,.1f} KiB"])
    return table(["version", "tensors read", "member bytes fetched", "of the model", "index"], table_rows)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _job(rank: int, world: int, port: int) -> Any:
    """This process as rank ``rank`` of a gloo job of ``world`` on 127.0.0.1, and its 1-D CPU mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


def _dcp_writer(rank: int, world: int, port: int, folder: str, checkpoint: str, size_mb: float) -> None:
    """Rank ``rank`` of ``world`` writes its rows of every tensor both ways: a DTensor state dict
    by ``torch.distributed.checkpoint.save``, and its pieces by ``publish_shard`` (rank 0 commits)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    mesh = _job(rank, world, port)
    model = _model(size_mb)
    dcp.save({key: DTensor.from_local(torch.from_numpy(piece.array), mesh, [Shard(0)])
              for key, piece in _pieces(model, rank, world).items()}, checkpoint_id=checkpoint)
    ws.publish_shard(folder, _pieces(model, rank, world), step=1, rank=rank, world=world, attempt=0)
    dist.barrier()
    if rank == 0:
        ws.commit_shards(folder, step=1, world=world, attempt=0, timeout=60)
    dist.destroy_process_group()


def _dcp_reader(rank: int, world: int, port: int, folder: str, checkpoint: str, size_mb: float, out: Any) -> None:
    """Rank ``rank`` of ``world`` reads its rows of every tensor (another partitioning than the
    writers'), by ``torch.distributed.checkpoint.load`` into DTensors and by ``read_region``:
    wall and CPU seconds and the most anonymous memory held above what it held before, the
    better of two tries each, taken in turn."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    from benchmarks.common import anon_during

    mesh = _job(rank, world, port)
    model = _model(size_mb)
    mine = _pieces(model, rank, world)
    share = sum(piece.array.nbytes for piece in mine.values())

    def by_dcp() -> dict[str, Any]:
        state = {key: DTensor.from_local(torch.empty(piece.array.shape), mesh, [Shard(0)])
                 for key, piece in mine.items()}
        dcp.load(state, checkpoint_id=checkpoint)
        return state

    def by_weightstore() -> dict[str, Any]:
        with ws.open(ws.latest(folder)) as store:
            return {key: store.read_region(key, (slice(piece.start[0], piece.start[0] + piece.array.shape[0]),))
                    for key, piece in mine.items()}

    best: dict[str, dict[str, float]] = {}
    for _ in range(2):
        for name, read in (("dcp", by_dcp), ("weightstore", by_weightstore)):
            dist.barrier()
            cpu = time.process_time()
            found = anon_during(read)
            found["cpu"] = time.process_time() - cpu
            if name not in best or found["seconds"] < best[name]["seconds"]:
                best[name] = found
    got = by_weightstore()
    assert all(got[key].tobytes() == piece.array.tobytes() for key, piece in mine.items())
    out.put((rank, share, best))
    dist.barrier()
    dist.destroy_process_group()


def read_vs_dcp(size_mb: float, writers: int = 4, readers: int = 3) -> str:
    """Per-rank read time and memory of ``readers`` ranks reading by rows a model ``writers``
    ranks wrote by rows, weightstore's ``read_region`` beside ``torch.distributed.checkpoint.load``
    on the same layout (a local folder each, in the page cache: what is compared is the work)."""
    context = multiprocessing.get_context("spawn")
    root = tempfile.mkdtemp(prefix="weightstore-shard-dcp-")
    folder, checkpoint = f"{root}/ws", f"{root}/dcp"
    try:
        port = _free_port()
        procs = [context.Process(target=_dcp_writer, args=(rank, writers, port, folder, checkpoint, size_mb))
                 for rank in range(writers)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
        assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
        out, port = context.Queue(), _free_port()
        procs = [context.Process(target=_dcp_reader, args=(rank, readers, port, folder, checkpoint, size_mb, out))
                 for rank in range(readers)]
        # glibc's mmap threshold fixed: large buffers are mapped and unmapped, never kept in the heap
        # by the one read for the next, so each read's peak is its own
        saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
        try:
            for proc in procs:
                proc.start()
        finally:
            if saved is None:
                os.environ.pop("MALLOC_MMAP_THRESHOLD_")
            else:
                os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
        found = sorted(out.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join(60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for rank, share, best in found:
        ours, theirs = best["weightstore"], best["dcp"]
        rows.append([str(rank), f"{share / MB:,.1f} MB", f"{ours['seconds']:.3f} ({ours['cpu']:.3f} CPU)",
                     f"{theirs['seconds']:.3f} ({theirs['cpu']:.3f} CPU)", fmt_ratio(ours["seconds"] / theirs["seconds"]),
                     fmt_ratio(ours["anon"] / share), fmt_ratio(theirs["anon"] / share)])
    return table(["reader rank", "its share", "weightstore s", "DCP s", "weightstore / DCP", "weightstore peak / share",
                  "DCP peak / share"], rows)


def rank_vs_dcp(size_mb: float, repeat: int = 3, busy: bool = False) -> str:
    """One rank's save and read against DCP's (table 4 of the module docstring); ``size_mb``
    is the model's, the rank holds a quarter."""
    import torch
    import torch.distributed.checkpoint as dcp

    world, rank = 4, 1
    model = _model(size_mb)
    mine = {key: ws.Piece(piece.array.copy(), piece.start, piece.shape)  # owned, as a rank's shard is
            for key, piece in _pieces(model, rank, world).items()}
    tensors = {key: torch.from_numpy(piece.array) for key, piece in mine.items()}
    share = sum(piece.array.nbytes for piece in mine.values())
    root = tempfile.mkdtemp(prefix="weightstore-shard-dcp-")
    try:
        folder = f"{root}/ws"
        _write(folder, model, world, step=1)  # the other ranks' members, so rank 1's rows read from a version
        ws.commit_shards(folder, step=1, world=world, attempt=0, timeout=60)
        dcp.save(tensors, checkpoint_id=f"{root}/dcp-read", no_dist=True)
        version = ws.latest(folder)
        rows = slice(mine[next(iter(mine))].start[0], mine[next(iter(mine))].start[0] + tensors[next(iter(mine))].shape[0])
        del model
        saved = iter(range(1, 1000))

        def ws_save() -> None:
            ws.publish_shard(f"{root}/ws-save", mine, step=next(saved), rank=rank, world=world, attempt=0)

        def ws_save_bare() -> None:
            ws.publish_shard(f"{root}/ws-save", mine, step=next(saved), rank=rank, world=world, attempt=0,
                             digests=False)

        def dcp_save() -> None:
            dcp.save(tensors, checkpoint_id=f"{root}/dcp-save-{next(saved)}", no_dist=True)

        def ws_read() -> None:
            with ws.open(version) as store:
                for key in mine:
                    store.read_region(key, (rows,))

        def dcp_read() -> None:
            dcp.load({key: torch.empty(value.shape) for key, value in tensors.items()},
                     checkpoint_id=f"{root}/dcp-read", no_dist=True)

        # in turn each round; a save's folder is removed before the next run (the page cache is not kept)
        runs = {"save ws": ws_save, "save dcp": dcp_save, "save, digests=False ws": ws_save_bare,
                "read ws": ws_read, "read dcp": dcp_read}
        found: dict[str, list[tuple[float, float]]] = {}
        with busy_neighbour(busy):
            for round_ in range(repeat + 1):  # the first round warms up
                for name, run in runs.items():
                    started, cpu = time.perf_counter(), time.process_time()
                    run()
                    if round_:
                        found.setdefault(name, []).append((time.perf_counter() - started, time.process_time() - cpu))
                    for entry in os.listdir(root):
                        if entry.startswith(("dcp-save-", "ws-save")):
                            shutil.rmtree(f"{root}/{entry}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = share / (1 << 30)
    rows_out = []
    for name, against in (("save", "save dcp"), ("save, digests=False", "save dcp"), ("read", "read dcp")):
        ours, theirs = found[f"{name} ws"], found[against]
        wall = [median([t[0] for t in ours]), median([t[0] for t in theirs])]
        cpu = [median([t[1] for t in ours]), median([t[1] for t in theirs])]
        ratios = [median([a[i] / b[i] for a, b in zip(ours, theirs, strict=True)]) for i in (0, 1)]  # round by round
        rows_out.append([name, f"{share / MB:,.0f} MB", f"{wall[0]:.3f} ({cpu[0] / gb:.2f} CPU-s/GB)",
                         f"{wall[1]:.3f} ({cpu[1] / gb:.2f} CPU-s/GB)", fmt_ratio(ratios[0]), fmt_ratio(ratios[1])])
    return table(["rank's", "share", "weightstore s", "DCP s", "wall ws/DCP", "CPU ws/DCP"], rows_out)


def save_phases(size_mb: float, repeat: int = 5) -> str:
    """Where a rank's save goes (``--phases``): each phase of ``publish_shard`` alone, on the
    rank's share (as table 4), with the library's own functions, CPU seconds of this thread
    per GB (median of ``repeat``): the strips' copy, their blocks' CRC-32s, the bands' change
    digests (CRC-64, what is saved now) against their BLAKE3 (before), and the write with and
    without fsync. What is left of a save's CPU is the table, done-record and index."""
    from weightstore.core.manifest import c_copy
    from weightstore.formats._sharded_index import band_crc64s, band_digests, block_crcs, piece_cut, tile_bytes

    pieces = [piece.array.copy() for piece in _pieces(_model(size_mb), 1, 4).values()]
    gb = sum(piece.nbytes for piece in pieces) / (1 << 30)
    columns, rows = piece_cut(pieces[0].shape, 4, tile_bytes(int(gb * (1 << 30))))
    width = columns or pieces[0].shape[1]
    strips = [c_copy(piece[:, at : at + width]) for piece in pieces for at in range(0, piece.shape[1], width)]
    root = tempfile.mkdtemp(prefix="weightstore-shard-phases-")

    def copy() -> None:  # one strip at a time, let go once written, as the save copies them
        for piece in pieces:
            for at in range(0, piece.shape[1], width):
                c_copy(piece[:, at : at + width])

    def write(durable: bool) -> None:
        with open(f"{root}/member", "wb", buffering=0) as file:
            for strip in strips:
                file.write(strip.data)
            if durable:
                os.fsync(file.fileno())
        os.unlink(f"{root}/member")

    phases = {"copy of the strips": copy,
              "CRC-32 of each block": lambda: [block_crcs(strip, rows * width * 4) for strip in strips],
              "CRC-64 of each band (change digests)": lambda: [band_crc64s(piece, rows) for piece in pieces],
              "BLAKE3 of each band (before)": lambda: [band_digests(piece, rows) for piece in pieces],
              "write": lambda: write(False), "write and fsync": lambda: write(True)}
    found = []
    try:
        for name, run in phases.items():
            times = []
            for _ in range(repeat):
                cpu = time.thread_time()
                run()
                times.append(time.thread_time() - cpu)
            found.append([name, f"{median(times) / gb:.3f}"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return table(["phase", "CPU-s/GB"], found)


def _writer(folder: str, size_mb: float, rank: int, world: int, start: object, out: object) -> None:
    model = _model(size_mb)
    start.wait()  # type: ignore[attr-defined]
    began = time.perf_counter()
    ws.publish_shard(folder, _pieces(model, rank, world), step=1, rank=rank, world=world, attempt=0)
    out.put((rank, began, time.perf_counter()))  # type: ignore[attr-defined]


def write_throughput(size_mb: float) -> str:
    context = multiprocessing.get_context("fork")
    rows = []
    nbytes = sum(v.nbytes for v in _model(size_mb).values())
    for world in (1, 2, 4):
        folder = tempfile.mkdtemp(prefix="weightstore-shard-bench-")
        start, out = context.Barrier(world), context.Queue()
        procs = [context.Process(target=_writer, args=(folder, size_mb, rank, world, start, out)) for rank in range(world)]
        for proc in procs:
            proc.start()
        times = [out.get(timeout=600) for _ in procs]
        for proc in procs:
            proc.join()
        began, ended = min(t[1] for t in times), max(t[2] for t in times)
        per_writer = [(nbytes / world) / (t[2] - t[1]) for t in times]
        ws.commit_shards(folder, step=1, world=world, attempt=0, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
        rows.append([str(world), f"{nbytes / MB / (ended - began):,.0f} MB/s",
                     f"{np.median(per_writer) / MB:,.0f} MB/s", f"{ended - began:.2f}"])
    return table(["writers", "aggregate", "per writer (median)", "s"], rows)


def bench(size_mb: float) -> None:
    import s3fs

    print(f"## Sharded versions: {size_mb:g} MB model ({machine_line()})\n")
    server = CountingS3().start()
    saved = use_environment(server)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        s3fs.S3FileSystem().mkdir(BUCKET)
        print("Commit of 4 ranks, counted at the S3 server (the coordinator reads done-records only):\n")
        print(commit_cost(server, size_mb), "\n")
        print("Bytes each reader fetches from a version written by 4 ranks by rows (S3):\n")
        print(reader_bytes(server, size_mb), "\n")
        print("Readers of thirds of versions written by 2-16 ranks by rows (S3; members and block tables):\n")
        print(other_worlds(server, size_mb), "\n")
        print("Bytes a torch module following the folder fetches per version; from version 2 on, one "
              "tensor of ten changed (S3):\n")
        print(follower_bytes(server, size_mb), "\n")
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
        restore_environment(saved)
    print("Read per rank against torch.distributed.checkpoint: 3 ranks reading by rows what 4 wrote by rows "
          "(local folders, gloo on 127.0.0.1; peak: anonymous memory held above the rank's before the read):\n")
    print(read_vs_dcp(size_mb), "\n")
    print("One rank (1 of 4) against torch.distributed.checkpoint: its save, and its rows read back "
          "(local folder; CPU: this process's, every thread):\n")
    print(rank_vs_dcp(size_mb), "\n")
    print("Write throughput, local folder (CPU-bound: this machine has "
          f"{multiprocessing.cpu_count()} cores; the per-writer figure is what scales with hosts):\n")
    print(write_throughput(size_mb))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=64)
    parser.add_argument("--vs-dcp", action="store_true", help="only table 4: one rank against DCP")
    parser.add_argument("--busy", action="store_true", help="table 4 beside a CPU-bound neighbour")
    parser.add_argument("--repeat", type=int, default=3, help="table 4's timed rounds")
    parser.add_argument("--phases", action="store_true", help="where one rank's save goes, phase by phase")
    args = parser.parse_args()
    if args.phases:
        print(f"## One rank's save, phase by phase: {args.size_mb:g} MB model, rank 1 of 4 ({machine_line()})\n")
        print(save_phases(args.size_mb))
        return
    if args.vs_dcp:
        print(f"## One rank against torch.distributed.checkpoint: {args.size_mb:g} MB model, rank 1 of 4"
              f"{', busy neighbour' if args.busy else ''} ({machine_line()})\n")
        print(rank_vs_dcp(args.size_mb, args.repeat, args.busy))
        return
    bench(args.size_mb)


if __name__ == "__main__":
    main()
