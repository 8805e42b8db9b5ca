"""Run every benchmark: ``python -m benchmarks [--size-mb N] [--repeat N] [--only NAME ...]``.

Each benchmark runs weightstore and the tools users would otherwise use in the same run and
prints medians and ratios. ``hold`` restores a model of 4x ``--size-mb`` with ``tf2.assign`` against
``Checkpoint.read`` (the issue's 4 GB row at the default size; it falls back where memory is short). Some cap the size: the publish benchmark trains a model of at most
256 MB (a step of a bigger one takes seconds here), and the S3 benchmark moves at most 64 MB
through a loopback server that is a CPU-bound Python process (count its requests and bytes,
not its seconds).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _core(size_mb: float, repeat: int) -> None:
    from benchmarks import core_bench

    core_bench.bench(size_mb, repeat)


def _tf(size_mb: float, repeat: int) -> None:
    from benchmarks import tf_bench

    tf_bench.bench(size_mb, repeat)


def _hold(size_mb: float, repeat: int) -> None:
    from benchmarks import tf_bench

    tf_bench.hold_bench(tf2_mb=4 * size_mb, tf1_mb=size_mb, small=50_000, repeat=repeat)


def _sync(size_mb: float, repeat: int) -> None:
    from benchmarks import sync_bench

    sync_bench.bench(size_mb, small_mb=4, repeat=repeat, poll=0.01, tensors=300, kinds=["tf2", "tf1"])


def _publish(size_mb: float, repeat: int) -> None:
    from benchmarks import publish_bench

    publish_bench.bench(min(size_mb, 256), repeat)


def _small(size_mb: float, repeat: int) -> None:
    from benchmarks import small_bench

    small_bench.bench(50_000, 256, repeat)


def _safetensors(size_mb: float, repeat: int) -> None:
    from benchmarks import safetensors_bench

    safetensors_bench.bench(size_mb, repeat)


def _checkpoints(size_mb: float, repeat: int) -> None:
    from benchmarks import ckpt_bench

    ckpt_bench.bench(size_mb, repeat)


def _s3(size_mb: float, repeat: int) -> None:
    from benchmarks import s3_bench

    s3_bench.bench(min(size_mb, 64), repeat)


def _torch(size_mb: float, repeat: int) -> None:
    from benchmarks import torch_bench

    torch_bench.bench(size_mb, repeat)


def _split(size_mb: float, repeat: int) -> None:
    from benchmarks import split_bench

    split_bench.bench(size_mb, max(repeat, 5))


def _artifacts(size_mb: float, repeat: int) -> None:
    from benchmarks import artifacts_bench

    artifacts_bench.bench(repeat)


def _shards(size_mb: float, repeat: int) -> None:
    from benchmarks import shard_bench

    shard_bench.bench(min(size_mb, 256))


BENCHMARKS: dict[str, Callable[[float, int], None]] = {
    "core": _core, "tf": _tf, "hold": _hold, "sync": _sync, "publish": _publish, "small": _small, "safetensors": _safetensors,
    "ckpt": _checkpoints, "s3": _s3, "torch": _torch, "artifacts": _artifacts, "split": _split,
    "shards": _shards,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--size-mb", type=float, default=1024, help="bytes of weights per benchmark (default 1024)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run these benchmarks only")
    args = parser.parse_args(argv)
    for number, name in enumerate(args.only or BENCHMARKS):
        if number:
            print()
        BENCHMARKS[name](args.size_mb, args.repeat)


if __name__ == "__main__":
    main()
