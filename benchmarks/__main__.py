"""Run every benchmark: ``python -m benchmarks [--size-mb N] [--repeat N] [--only core|tf|sync|publish]``.

The publish benchmark trains a model of at most 256 MB (a step of a bigger one takes seconds here).
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--size-mb", type=float, default=1024, help="bytes of weights per benchmark (default 1024)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--only", choices=["core", "tf", "sync", "publish"], help="run one benchmark")
    args = parser.parse_args(argv)
    if args.only in (None, "core"):
        from benchmarks import core_bench

        core_bench.bench(args.size_mb, args.repeat)
    if args.only in (None, "tf"):
        from benchmarks import tf_bench

        if args.only is None:
            print()
        tf_bench.bench(args.size_mb, args.repeat)
    if args.only in (None, "sync"):
        from benchmarks import sync_bench

        if args.only is None:
            print()
        sync_bench.bench(args.size_mb, small_mb=4, repeat=args.repeat, poll=0.01, tensors=300, kinds=["tf2", "tf1"])
    if args.only in (None, "publish"):
        from benchmarks import publish_bench

        if args.only is None:
            print()
        publish_bench.bench(min(args.size_mb, 256), args.repeat)


if __name__ == "__main__":
    main()
