"""TF checkpoint read benchmark: weightstore's TF-free reader against TensorFlow's.

The core benchmark's weights (float32 arrays, 256 B to 100 MB) are saved once by
TensorFlow's ``SaveV2`` as a name-based checkpoint, then read whole, in one run, by

- ``tf.train.load_checkpoint`` + ``get_tensor`` of every tensor (TensorFlow verifies each
  tensor's CRC-32C as it reads);
- ``ws.load(prefix)`` in a process where TensorFlow is never imported, with the CRC-32C
  verified (the default) and with ``verify=False``.

Every array is summed after the read, so a lazily mapped tensor pays for its page reads.
Each case runs in its own process, warms up once (the page cache then holds the files for
all of them) and repeats; medians and the ratio to TensorFlow are printed. TensorFlow's own
import, paid once per process by any TF reader, is reported on its own line.

    python -m benchmarks.ckpt_bench                 # 1 GB, 5 repetitions
    python -m benchmarks.ckpt_bench --size-mb 256   # quicker
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from benchmarks.common import emit, fmt_mb, fmt_ratio, fmt_seconds, machine_line, measure, run_case, table, touch
from benchmarks.core_bench import prepare, read_weights

MODULE = "benchmarks.ckpt_bench"
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3"}
PREFIX = "ckpt/model"
CASES = {
    "tf": "tf.train.load_checkpoint + get_tensor",
    "ws": "ws.load, CRC-32C verified (no TensorFlow)",
    "ws-noverify": "ws.load(verify=False) (no TensorFlow)",
}


def _write(folder: str) -> dict:
    import tensorflow as tf

    weights = read_weights(folder)
    os.makedirs(os.path.join(folder, os.path.dirname(PREFIX)), exist_ok=True)
    with tf.device("/cpu:0"):
        tf.raw_ops.SaveV2(prefix=os.path.join(folder, PREFIX), tensor_names=list(weights),
                          shape_and_slices=[""] * len(weights), tensors=[tf.constant(v) for v in weights.values()])
    return {"tensors": len(weights)}


def _case_tf(folder: str, repeat: int) -> dict:
    start = time.perf_counter()
    import tensorflow as tf

    imported = time.perf_counter() - start
    prefix = os.path.join(folder, PREFIX)

    def run():
        reader = tf.train.load_checkpoint(prefix)
        arrays = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
        touch(arrays)
        return arrays

    return {**measure(run, repeat=repeat), "import": imported}


def _case_ws(folder: str, repeat: int, verify: bool) -> dict:
    sys.modules["tensorflow"] = None  # type: ignore[assignment]  # prove the reader never needs it
    import weightstore as ws

    prefix = os.path.join(folder, PREFIX)

    def run():
        arrays = ws.load(prefix, verify=verify)
        touch(arrays)
        return arrays

    return measure(run, repeat=repeat)


def bench(size_mb: float = 1024, repeat: int = 5) -> dict[str, dict]:
    """Write a ``size_mb`` checkpoint, read it every way, print a table; return the results."""
    folder = tempfile.mkdtemp(prefix="ws-ckpt-bench-")
    try:
        info = prepare(folder, size_mb)
        written = run_case(MODULE, "write", [folder], env=QUIET)
        results = {case: run_case(MODULE, case, [folder, str(repeat)], env=QUIET) for case in CASES}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base = results["tf"]["median"]
    print(f"TF checkpoint read, {fmt_mb(info['bytes'])} MB in {written['tensors']} float32 tensors, "
          f"median of {repeat}; {machine_line()}")
    rows = [[CASES[case], fmt_seconds(r["median"]), fmt_seconds(min(r["times"])), fmt_ratio(r["median"] / base),
             fmt_mb(r["peak"])] for case, r in results.items()]
    rows.append(["import tensorflow (once per process)", fmt_seconds(results["tf"]["import"]), "-", "-", "-"])
    print(table(["reader", "median s", "best s", "vs TF", "peak MB"], rows))
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case is None:
        bench(args.size_mb, args.repeat)
    elif args.case == "write":
        emit(_write(args.args[0]))
    elif args.case == "tf":
        emit(_case_tf(args.args[0], int(args.args[1])))
    else:
        emit(_case_ws(args.args[0], int(args.args[1]), verify=args.case == "ws"))


if __name__ == "__main__":
    main()
