"""Delta versions: bytes per version, bytes a follower fetches, publish CPU, against full versions.

Three trainers publish every step to two folders on moto's S3 server on 127.0.0.1 (its own
process, counting every body byte): one with full versions, one with ``delta=ws.Delta(...)``.

- ``bf16-adam``: a small Keras transformer (built from its config, random init) trained with
  Adam at 3e-6 on synthetic tokens; its bf16 copy is published every step;
- ``fp32-adam``: the same model in fp32 at 1e-3;
- ``synthetic``: ``--synthetic-mb`` of bf16 in which 2% of the elements move one step per version.

A ``Follower`` per folder (into ``tf.Variable``\\ s) follows the first ``--followed`` versions one by
one (bytes the server sent per version after the first, the publisher's own reads included; the
delta folder's follower is made with ``deltas=True``, so it keeps a copy of what it holds from
the first version on), then stops while
``--skipped`` more are published and catches up at once (the bytes of that catch-up). Publish
CPU (all threads, ``time.process_time``) and wall time per GB are measured apart, publishing the
same steps to two local folders (totals over the steps, ``--rounds`` pairs in turn: medians, and a
ratio per pair, its median and spread). Ratios are of
the full version's bytes. ``--follow-mb`` also times a follower of that many MB of bf16 (2%
changed per version), local and on S3: from ``LATEST`` naming a version to it serving, and the
serving stall of that swap. ``--sharded-ranks`` measures sharded delta versions (``publish_shard``
by that many ranks): bytes per version, and what a follower fetches per version and after the
skipped ones, against single-writer delta versions of the same steps, and what a follower that
stages regions (TF1 partitioned variables) fetches.

    python -m benchmarks.delta_bench                       # 96 MB synthetic, the default model
    python -m benchmarks.delta_bench --synthetic-mb 16 --width 128 --layers 2
    python -m benchmarks.delta_bench --only none --follow-mb 256   # follower latency and stall only
    python -m benchmarks.delta_bench --only fp32-adam --layers 6 --width 640 --followed 4 --skipped 5 --cpu-only --rounds 7
    python -m benchmarks.delta_bench --only none --sharded-ranks 2 --synthetic-mb 96 --followed 4 --skipped 6
    python -m benchmarks.delta_bench --depth 1000                # each verb on a chain 1,000 deep
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

import weightstore as ws
from benchmarks.common import machine_line, table
from benchmarks.s3_server import ServerProcess, restore_environment, use_environment

BUCKET = "weightstore-delta-bench"


def keras_steps(count: int, *, bf16: bool, lr: float, layers: int, width: int, seq: int = 32, vocab: int = 2000,
                batch: int = 8) -> Iterator[dict[str, np.ndarray]]:
    """The weights after each of ``count`` Adam steps of a small transformer on random tokens."""
    import keras

    from weightstore.adapters import tf2

    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq,), dtype="int32")
    hidden = keras.layers.Embedding(vocab, width)(tokens)
    for _ in range(layers):
        attended = keras.layers.MultiHeadAttention(4, width // 4)(hidden, hidden)
        hidden = keras.layers.LayerNormalization()(hidden + attended)
        fed = keras.layers.Dense(width, name=None)(keras.layers.Dense(4 * width, activation="gelu")(hidden))
        hidden = keras.layers.LayerNormalization()(hidden + fed)
    built = keras.Model(tokens, keras.layers.Dense(vocab)(hidden))
    model = keras.Model.from_config(built.get_config())  # from its config, freshly initialised
    model.compile(optimizer=keras.optimizers.Adam(lr), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, vocab, (batch, seq)), rng.integers(0, vocab, (batch, seq))
    for _ in range(count):
        model.train_on_batch(x, y)
        weights = {key: np.asarray(value) for key, value in tf2.export(model).items()}
        yield {key: value.astype(ml_dtypes.bfloat16) for key, value in weights.items()} if bf16 else weights


def synthetic_steps(count: int, size_mb: float, fraction: float = 0.02) -> Iterator[dict[str, np.ndarray]]:
    """``size_mb`` of bf16 in 16 tensors; each step moves ``fraction`` of the elements by one ulp."""
    rng = np.random.default_rng(0)
    per = int(size_mb * (1 << 20) / 2 / 16)
    bits = [rng.standard_normal(per).astype(ml_dtypes.bfloat16).view(np.uint16) for _ in range(16)]
    for _ in range(count):
        for tensor in bits:
            tensor[rng.integers(0, per, int(per * fraction))] += 1
        yield {f"layer_{i:02d}/kernel": tensor.view(ml_dtypes.bfloat16).copy() for i, tensor in enumerate(bits)}


def follower_target(weights: dict[str, np.ndarray]) -> dict[str, Any]:
    import tensorflow as tf

    return {key: tf.Variable(tf.zeros(value.shape, tf.bfloat16 if value.dtype == ml_dtypes.bfloat16 else value.dtype))
            for key, value in weights.items()}


def publish_cpu(steps: list[dict[str, np.ndarray]], anchor_every: int, rounds: int = 3) -> dict[str, Any]:
    """CPU and wall seconds per GB of publishing ``steps`` to a local folder, full and delta,
    ``rounds`` pairs in turn: the medians of each round's total over the steps after the first
    (a full version either way), and of each pair's ratio with its spread (``*_ratios``): a
    machine whose speed drifts moves both of a pair. Totals, not a median step: a publisher
    whose deltas alternate with anchors (fp32) pays for both."""
    found: dict[str, list[float]] = {}
    gb = sum(value.nbytes for value in steps[0].values()) / 1e9 * (len(steps) - 1)
    for _ in range(rounds):
        for mode in ("full", "delta"):
            delta = ws.Delta(anchor_every=anchor_every) if mode == "delta" else False
            with tempfile.TemporaryDirectory(dir=os.environ.get("WS_BENCH_DIR")) as folder:
                cpu = wall = 0.0
                for step, weights in enumerate(steps, 1):
                    started, used = time.perf_counter(), time.process_time()
                    ws.publish(folder, weights, step=step, keep=3, delta=delta)
                    if step > 1:
                        cpu += time.process_time() - used
                        wall += time.perf_counter() - started
            found.setdefault(f"{mode}_cpu", []).append(cpu / gb)
            found.setdefault(f"{mode}_wall", []).append(wall / gb)
    medians: dict[str, Any] = {name: float(np.median(values)) for name, values in found.items()}
    for kind in ("cpu", "wall"):
        medians[f"{kind}_ratios"] = [delta / full for full, delta in zip(found[f"full_{kind}"], found[f"delta_{kind}"],
                                                                          strict=True)]
    return medians


def follow_latency(server: ServerProcess, size_mb: float, versions: int, anchor_every: int) -> list[list[str]]:
    """Per store (local, S3) and mode (full, delta): the time from ``LATEST`` naming a version to
    the follower serving it, and the serving stall of that swap (the longest wait of a prober
    entering ``reading()`` meanwhile, holding it 0.5 ms: an inference call), medians over the
    versions after the first; ``size_mb`` of bf16, 2% of it changed per version."""
    import threading

    from weightstore.adapters.serving.follower import Follower

    steps = list(synthetic_steps(versions, size_mb))
    rows = []
    for store in ("local", "s3"):
        found: dict[str, tuple[float, float]] = {}
        for mode in ("full", "delta"):
            with tempfile.TemporaryDirectory(dir=os.environ.get("WS_BENCH_DIR")) as local:
                folder = local if store == "local" else f"s3://{BUCKET}/follow-{mode}-{uuid.uuid4().hex[:8]}"
                delta = ws.Delta(anchor_every=anchor_every) if mode == "delta" else False
                follower = Follower(follower_target(steps[0]), folder, poll=0.01, deltas=mode == "delta" or None)
                waits: list[tuple[float, float]] = []
                stop = threading.Event()

                def probe(follower: Follower = follower, stop: threading.Event = stop,
                          waits: list[tuple[float, float]] = waits) -> None:
                    while not stop.is_set():
                        entered = time.perf_counter()
                        with follower.reading():
                            waits.append((entered, time.perf_counter() - entered))
                            time.sleep(0.0005)

                prober = threading.Thread(target=probe, daemon=True)
                latency, stall = [], []
                try:
                    follower.start()
                    prober.start()
                    for step, weights in enumerate(steps, 1):
                        ws.publish(folder, weights, step=step, keep=3, delta=delta)
                        named = time.perf_counter()
                        assert follower.wait(step, timeout=600) is not None
                        served = time.perf_counter()
                        if step > 1:
                            latency.append(served - named)
                            stall.append(max((waited for entered, waited in list(waits) if named <= entered + waited
                                              and entered <= served), default=0.0))
                    assert follower.error is None, follower.error
                finally:
                    stop.set()
                    prober.join()
                    follower.stop()
                found[mode] = (float(np.median(latency)), float(np.median(stall)))
        (full_latency, full_stall), (delta_latency, delta_stall) = found["full"], found["delta"]
        rows.append([store, f"{size_mb:g} MB", f"{full_latency:.2f} s", f"{delta_latency:.2f} s",
                     f"{delta_latency / full_latency:.2f}x", f"{full_stall * 1e3:.0f} ms", f"{delta_stall * 1e3:.0f} ms",
                     f"{delta_stall / max(full_stall, 1e-9):.2f}x"])
    return rows


def partitioned_target(weights: dict[str, np.ndarray], parts: int) -> Any:
    """A TF1 session holding ``weights``' shapes, each variable partitioned ``parts`` ways by rows:
    a follower stages the regions of its parts, not whole tensors."""
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        for key, value in weights.items():
            v1.get_variable(key, value.shape, tf.bfloat16, v1.zeros_initializer(),
                            partitioner=v1.fixed_size_partitioner(parts))
        init = v1.global_variables_initializer()
    session = v1.Session(graph=graph)
    session.run(init)
    graph.finalize()
    return session


def follow_bytes(server: ServerProcess, publishers: dict[str, Any], steps: list[dict[str, np.ndarray]],
                 followed: int, skipped: int, targets: dict[str, Any] | None = None
                 ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """A ``Follower`` per folder (``deltas=True`` where its name says delta) follows the first
    ``followed`` versions one by one, stops while ``skipped`` more are published (each folder's
    ``publishers[folder](folder, weights, step, keep)``) and catches up: bytes the server sent
    per version (the publisher's own reads included) and for the catch-up; every follower ends
    holding the trainer's last bytes. A folder's target is ``tf.Variable``\\ s, or ``targets``'."""
    from weightstore.adapters import tf1
    from weightstore.adapters.serving.follower import Follower

    keep = skipped + 2  # the version a follower holds stays while it catches up
    targets = {folder: (targets or {}).get(folder) or follower_target(steps[0]) for folder in publishers}
    followers = {folder: Follower(targets[folder], folder, poll=0.02, deltas=True if "delta" in folder else None)
                 for folder in targets}
    fetched: dict[str, list[int]] = {folder: [] for folder in publishers}
    try:
        for follower in followers.values():
            follower.start()
        for step, weights in enumerate(steps[:followed], 1):
            for folder, publish in publishers.items():
                server.reset()
                publish(folder, weights, step, keep)
                followers[folder].wait(step, timeout=600)
                fetched[folder].append(server.counts()["sent"])
        for follower in followers.values():
            follower.stop()
        for step, weights in enumerate(steps[followed:], followed + 1):
            for folder, publish in publishers.items():
                publish(folder, weights, step, keep)
        caught_up = {}
        for folder, follower in followers.items():
            server.reset()
            follower.start()
            follower.wait(len(steps), timeout=600)
            caught_up[folder] = server.counts()["sent"]
            assert follower.error is None, follower.error
        for target in targets.values():  # the follower holds the trainer's last bytes
            held = tf1.export(target) if not isinstance(target, dict) else {
                key: variable.numpy() for key, variable in target.items()}
            for key, value in held.items():
                assert np.asarray(value).tobytes() == steps[-1][key].tobytes(), key
    finally:
        for follower in followers.values():
            follower.stop()
    return fetched, caught_up


def sharded_follow(server: ServerProcess, ranks: int, size_mb: float, followed: int, skipped: int,
                   anchor_every: int) -> list[list[str]]:
    """Bytes a follower fetches per version and after ``skipped`` missed versions, on S3: of
    sharded delta versions by ``ranks`` ranks (a ``ws.Delta`` each) against single-writer delta
    versions of the same steps, and of the sharded versions followed into TF1 variables
    partitioned ``ranks`` ways (its parts the ranks' pieces) and ``ranks + 1`` ways (parts across
    pieces), whose follower stages regions. Ratios of the model's bytes."""
    steps = list(synthetic_steps(followed + skipped, size_mb))
    model = sum(value.nbytes for value in steps[0].values())
    kinds = {"sharded": ranks, "single": 1, f"sharded, regions of {ranks} parts": ranks,
             f"sharded, regions of {ranks + 1} parts": ranks}
    deltas = {kind: [ws.Delta(anchor_every=anchor_every) for _ in range(ranks)] for kind in kinds}

    def publish_sharded(folder: str, weights: dict[str, np.ndarray], step: int, keep: int, kind: str) -> None:
        for rank in range(ranks):
            pieces = {}
            for key, value in weights.items():
                cut = [len(value) * r // ranks for r in range(ranks + 1)]
                pieces[key] = ws.Piece(value[cut[rank] : cut[rank + 1]], (cut[rank],), value.shape)
            ws.publish_shard(folder, pieces, step=step, rank=rank, world=ranks, attempt=0, delta=deltas[kind][rank])
        ws.commit_shards(folder, step=step, world=ranks, attempt=0, timeout=60, keep=keep)

    def publish_single(folder: str, weights: dict[str, np.ndarray], step: int, keep: int, kind: str) -> None:
        ws.publish(folder, weights, step=step, keep=keep, delta=deltas[kind][0])

    folders = {kind: f"s3://{BUCKET}/follow-{kind.split(',')[0]}-delta-{uuid.uuid4().hex[:8]}" for kind in kinds}
    fetched, caught_up = follow_bytes(server, {
        folder: functools.partial(publish_single if kind == "single" else publish_sharded, kind=kind)
        for kind, folder in folders.items()}, steps, followed, skipped, targets={
        folders[kind]: partitioned_target(steps[0], int(kind.split()[-2])) for kind in kinds if "regions" in kind})
    return [[kind, f"{kinds[kind]}", f"{model / 1e6:.1f} MB",
             f"{np.mean(fetched[folder][1:]) / model:.3f}x", f"{caught_up[folder] / model:.3f}x"]
            for kind, folder in folders.items()]


def scenario(server: ServerProcess, name: str, steps: list[dict[str, np.ndarray]], followed: int, skipped: int,
             anchor_every: int) -> dict[str, Any]:
    full_folder, delta_folder = (f"s3://{BUCKET}/{name}-{kind}-{uuid.uuid4().hex[:8]}" for kind in ("full", "delta"))
    delta = ws.Delta(anchor_every=anchor_every)
    fetched, caught_up = follow_bytes(server, {
        full_folder: lambda folder, weights, step, keep: ws.publish(folder, weights, step=step, keep=keep),
        delta_folder: lambda folder, weights, step, keep: ws.publish(folder, weights, step=step, keep=keep,
                                                                     delta=delta)}, steps, followed, skipped)
    listed = {entry.step: entry for entry in ws.sync.list_versions(delta_folder)}
    full_bytes = next(entry.size for entry in ws.sync.list_versions(full_folder))
    deltas = [entry.size for entry in listed.values() if entry.kind == "delta"]
    return {
        "model": sum(value.nbytes for value in steps[0].values()), "full": full_bytes,
        "delta_per_version": float(np.mean(deltas)) / full_bytes if deltas else None,
        "anchors": sum(entry.kind == "full" for entry in listed.values()), "versions": len(listed),
        "follow_full": float(np.mean(fetched[full_folder][1:])) / full_bytes,
        "follow_delta": float(np.mean(fetched[delta_folder][1:])) / full_bytes,
        "skip_full": caught_up[full_folder] / full_bytes, "skip_delta": caught_up[delta_folder] / full_bytes,
    }


def bench(*, synthetic_mb: float, layers: int, width: int, followed: int, skipped: int, anchor_every: int,
          only: list[str] | None = None, follow_mb: float = 0, follow_versions: int = 5, cpu_only: bool = False,
          rounds: int = 3) -> None:
    count = followed + skipped
    makers = {
        "bf16-adam": lambda: list(keras_steps(count, bf16=True, lr=3e-6, layers=layers, width=width)),
        "fp32-adam": lambda: list(keras_steps(count, bf16=False, lr=1e-3, layers=layers, width=width)),
        "synthetic": lambda: list(synthetic_steps(count, synthetic_mb)),
    }
    if cpu_only:  # a model of hundreds of MB: its versions through the S3 server and followers take minutes
        cpu_rows = [cpu_row(name, make()[:9], anchor_every, rounds) for name, make in makers.items()
                    if not only or name in only]
        print(machine_line())
        print(f"publish CPU: {rounds} pairs (full, delta) in turn")
        print(table(CPU_COLUMNS, cpu_rows))
        return
    server = ServerProcess()
    saved = use_environment(server)
    rows, cpu_rows = [], []
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(BUCKET)
        for name, make in makers.items():
            if only and name not in only:
                continue
            steps = make()
            r = scenario(server, name, steps, followed, skipped, anchor_every)
            rows.append([name, f"{r['model'] / 1e6:.1f} MB", f"{r['delta_per_version']:.3f}x",
                         f"{r['anchors']}/{r['versions']}", f"{r['follow_full']:.3f}x", f"{r['follow_delta']:.3f}x",
                         f"{r['skip_full']:.3f}x", f"{r['skip_delta']:.3f}x"])
            cpu_rows.append(cpu_row(name, steps[:9], anchor_every, rounds))
        follow_rows = follow_latency(server, follow_mb, follow_versions, anchor_every) if follow_mb else []
    finally:
        server.stop()
        restore_environment(saved)
    print(machine_line())
    if rows:
        print_scenarios(rows, cpu_rows, followed, skipped, anchor_every)
    if follow_rows:
        print(f"follower: LATEST names a version -> it serves (latency), and the serving stall; medians of "
              f"{follow_versions - 1} versions")
        print(table(["store", "model", "latency full", "delta", "ratio", "stall full", "delta", "ratio"], follow_rows))


CPU_COLUMNS = ["case", "publish CPU s/GB full", "delta", "ratio (pairs' median)", "spread", "wall s/GB full", "delta",
               "ratio", "spread"]


def cpu_row(name: str, steps: list[dict[str, np.ndarray]], anchor_every: int, rounds: int = 3) -> list[str]:
    """A table row of :func:`publish_cpu`'s figures: medians, and the ratio of each pair's
    median with the lowest and highest pair's."""
    c = publish_cpu(steps, anchor_every, rounds)
    cpu, wall = c["cpu_ratios"], c["wall_ratios"]
    return [name, f"{c['full_cpu']:.2f}", f"{c['delta_cpu']:.2f}", f"{np.median(cpu):.2f}x",
            f"{min(cpu):.2f}-{max(cpu):.2f}", f"{c['full_wall']:.2f}", f"{c['delta_wall']:.2f}",
            f"{np.median(wall):.2f}x", f"{min(wall):.2f}-{max(wall):.2f}"]


def sharded(ranks: int, size_mb: float, versions: int, anchor_every: int) -> list[list[str]]:
    """Bytes per version written by ``ranks`` ranks (``publish_shard``, in this process one after
    another, each 16 tensors' rows split among them) of the synthetic bf16 model, full and with a
    ``ws.Delta`` per rank, in two local folders; the first (full either way) not counted. Every
    file of a version counts: members, block tables, done-records, index."""
    steps = list(synthetic_steps(versions, size_mb))
    model = sum(value.nbytes for value in steps[0].values())
    rows, sizes = [], {}
    with tempfile.TemporaryDirectory() as root:
        for kind in ("full", "delta"):
            folder = os.path.join(root, kind)
            deltas = [ws.Delta(anchor_every=anchor_every) for _ in range(ranks)]
            cpu = wall = 0.0
            for step, weights in enumerate(steps, 1):
                started, spent = time.perf_counter(), time.process_time()
                for rank in range(ranks):
                    pieces = {}
                    for key, value in weights.items():
                        cut = [len(value) * r // ranks for r in range(ranks + 1)]
                        pieces[key] = ws.Piece(value[cut[rank] : cut[rank + 1]], (cut[rank],), value.shape)
                    ws.publish_shard(folder, pieces, step=step, rank=rank, world=ranks, attempt=0,
                                     delta=deltas[rank] if kind == "delta" else False)
                ws.commit_shards(folder, step=step, world=ranks, attempt=0, timeout=60, keep=None)
                if step > 1:
                    cpu, wall = cpu + time.process_time() - spent, wall + time.perf_counter() - started
            written = []
            for step in range(2, versions + 1):
                attempt = os.path.join(folder, f"step-{step:012d}.attempt-0")
                written.append(sum(os.path.getsize(os.path.join(attempt, name)) for name in os.listdir(attempt))
                               + os.path.getsize(os.path.join(folder, f"step-{step:012d}.wsindex")))
            sizes[kind] = (sum(written) / len(written), cpu, wall)
    gb = model * (versions - 1) / 1e9
    for kind, (per, cpu, wall) in sizes.items():
        rows.append([kind, f"{ranks}", f"{model / 1e6:.1f} MB", f"{per / 1e6:.2f} MB", f"{per / model:.3f}x",
                     f"{cpu / gb:.2f}", f"{wall / gb:.2f}"])
    return rows


def print_scenarios(rows: list[list[str]], cpu_rows: list[list[str]], followed: int, skipped: int,
                    anchor_every: int) -> None:
    print(f"delta versions: {followed} versions followed one by one, then {skipped} skipped; anchor_every="
          f"{anchor_every}; ratios of a full version's bytes")
    print(table(["case", "model", "delta file / version", "anchors/versions", "follower fetch / version (full)",
                 "(delta)", f"catch-up after {skipped} (full)", "(delta)"], rows))
    print(table(CPU_COLUMNS, cpu_rows))


def depth_costs(depth: int, tensors: int = 16, elements: int = 4096) -> list[list[str]]:
    """Seconds each verb takes on a chain ``depth`` deltas deep (``anchor_every=depth + 1``):
    ``tensors`` fp32 tensors of ``elements``, one element of one of them changed per step (a
    chain that deep must stay under a full version's bytes). The ``ws`` commands run as the
    real command (a fresh process each: ``ws --version`` times its start-up), each asserted to
    succeed (``ws diff``: to find the change); the rest in this process. A follower (a torch
    module, ``deltas=True``) starts at the middle of the chain and catches up to the version below
    its head, then to its head (one version: what a follower that keeps up pays each version); a
    fresh one starts at the head; the last publish is timed remembering its base (``keep=5``, the
    default: it prunes nothing, each version is needed) and, on a copy of the folder, reading it
    back."""
    import shutil
    import subprocess
    import sys

    import torch

    from weightstore.adapters.serving.follower import Follower

    weights = {f"t{index:02d}": np.zeros(elements, np.float32) for index in range(tensors)}
    rows: list[list[str]] = []

    def timed(verb: str, run: Any) -> Any:
        started = time.perf_counter()
        result = run()
        rows.append([verb, f"{time.perf_counter() - started:.3f}"])
        return result

    def module() -> torch.nn.Module:
        held = torch.nn.Module()
        for key, value in weights.items():
            held.register_parameter(key, torch.nn.Parameter(torch.zeros(value.shape), requires_grad=False))
        return held

    def publish(folder: str, step: int, delta: ws.Delta, keep: int | None = None) -> None:
        weights[f"t{step % tensors:02d}"][step % elements] += 1
        ws.publish(folder, weights, step=step, delta=delta, keep=keep)

    def command(*args: str, status: int = 0) -> None:
        done = subprocess.run([sys.executable, "-m", "weightstore", *args], check=False, capture_output=True)
        assert done.returncode == status, done.stderr.decode()[-2000:]

    with tempfile.TemporaryDirectory(dir=os.environ.get("WS_BENCH_DIR")) as root:
        folder, head = os.path.join(root, "run"), depth + 1
        delta = ws.Delta(anchor_every=depth + 1)
        middle = depth // 2 + 1
        for step in range(1, middle + 1):
            publish(folder, step, delta)
        follower = Follower(module(), folder, poll=0.01, deltas=True).start()
        follower.wait(middle, timeout=600)
        follower.stop()
        for step in range(middle + 1, head):
            publish(folder, step, delta)
        saved = {key: value.copy() for key, value in weights.items()}
        shutil.copytree(folder, os.path.join(root, "copy"))
        timed(f"follower catching up {head - 1 - middle} versions", lambda: (follower.start(), follower.wait(
            head - 1, timeout=600), follower.stop()))
        timed(f"ws.publish onto depth {depth - 1} (base remembered, keep=5)", lambda: publish(folder, head, delta, 5))
        weights.update(saved)
        timed(f"ws.publish onto depth {depth - 1} (base read back)", lambda: publish(
            os.path.join(root, "copy"), head, ws.Delta(anchor_every=depth + 1, remember=False)))
        timed("follower catching up 1 version", lambda: (follower.start(), follower.wait(head, timeout=600),
                                                         follower.stop()))
        timed("follower starting fresh", lambda: (fresh := Follower(module(), folder, poll=0.01, deltas=True).start(),
                                                   fresh.wait(head, timeout=600), fresh.stop()))
        top = os.path.join(folder, f"step-{head:012d}.wsdelta")
        timed("ws.open of the head", lambda: ws.open(top).close())
        timed("ws.latest + ws.load", lambda: ws.load(ws.latest(folder)))
        timed("ws --version (start-up)", lambda: command("--version"))
        timed("ws versions", lambda: command("versions", folder))
        timed("ws ls of the head", lambda: command("ls", top))
        timed("ws diff anchor head", lambda: command("diff", os.path.join(folder, "step-000000000001.npz"), top,
                                                               status=1))
        timed("ws verify", lambda: command("verify", folder))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic-mb", type=float, default=96)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--followed", type=int, default=6)
    parser.add_argument("--skipped", type=int, default=10)
    parser.add_argument("--anchor-every", type=int, default=20)
    parser.add_argument("--only", nargs="*", choices=["bf16-adam", "fp32-adam", "synthetic", "none"])
    parser.add_argument("--follow-mb", type=float, default=0, help="also time a follower of this many MB (0: not)")
    parser.add_argument("--follow-versions", type=int, default=5)
    parser.add_argument("--cpu-only", action="store_true",
                        help="only the publish CPU of each case (no S3 server, no followers): for models of 64 MB+")
    parser.add_argument("--rounds", type=int, default=3,
                        help="pairs (full, delta) of publishes whose CPU is measured, in turn; ratios are medians of pairs'")
    parser.add_argument("--sharded-ranks", type=int, default=0,
                        help="also measure publish_shard by this many ranks (synthetic model; 0: not)")
    parser.add_argument("--depth", type=int, default=0,
                        help="only time each verb on a chain this many deltas deep (small tensors; 0: not)")
    args = parser.parse_args()
    if args.depth:
        print(machine_line())
        print(f"a chain {args.depth} deltas deep: 16 fp32 tensors of 16 KiB, one element changed per version")
        print(table(["verb", "seconds"], depth_costs(args.depth)))
        return
    if args.sharded_ranks:
        print(machine_line())
        print(f"sharded versions of {args.sharded_ranks} ranks, synthetic bf16, 2% changed per version; "
              f"{args.followed + args.skipped} versions, anchor_every={args.anchor_every}; all files of a version")
        print(table(["kind", "ranks", "model", "bytes / version", "of the model", "publish CPU s/GB", "wall s/GB"],
                    sharded(args.sharded_ranks, args.synthetic_mb, args.followed + args.skipped, args.anchor_every)))
        server = ServerProcess()
        saved = use_environment(server)
        try:
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir(BUCKET)
            rows = sharded_follow(server, args.sharded_ranks, args.synthetic_mb, args.followed, args.skipped,
                                  args.anchor_every)
        finally:
            server.stop()
            restore_environment(saved)
        print(f"a follower on S3 (deltas=True): {args.followed} versions one by one, then {args.skipped} skipped; "
              "bytes the server sent, of the model's")
        print(table(["versions", "ranks", "model", "fetch / version", f"catch-up after {args.skipped}"], rows))
        if args.only == ["none"] and not args.follow_mb:
            return
    bench(synthetic_mb=args.synthetic_mb, layers=args.layers, width=args.width, followed=args.followed,
          skipped=args.skipped, anchor_every=args.anchor_every, only=args.only, follow_mb=args.follow_mb,
          follow_versions=args.follow_versions, cpu_only=args.cpu_only, rounds=args.rounds)


if __name__ == "__main__":
    main()
