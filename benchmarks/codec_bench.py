"""``compress="shuffle"`` (weightstore's shuffle-zstd member) against blosc2 doing the same.

The question: keep the private ``\\x93WSZSTD\\x01`` container, or store blosc2's
published frame, which other tools read? Measured here on trained-like weights (see
``core_bench.trained_like``), codec against codec in one process, round-robin so every variant
sees the same load on a shared machine:

* ratio: raw bytes / encoded bytes;
* load GB/s: decoding plus the CRC-32 of the plain bytes a verified read needs (shuffle-zstd
  takes it block by block as it decodes; blosc2 has no CRC-32, so it is taken after), by the
  wall clock and per CPU-second of all threads (the figure a busy machine disturbs least);
* hostile input: a frame whose header claims 2 GiB, and random byte damage to a valid
  frame, each decoded in a child process: how often it raised, returned wrong bytes silently
  (only the manifest's CRC would catch them), or killed the process, and the most memory
  one decode took.

    python -m benchmarks.codec_bench --size-mb 16      # a smoke run
    python -m benchmarks.codec_bench --size-mb 256 --rounds 7
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import numpy as np

from benchmarks.common import MB, machine_line, table


def trained(size_mb: float, dtype: str) -> np.ndarray:
    """normal(0, 0.05) moved by three SGD-like steps, as ``core_bench.trained_like`` makes them."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    count = int(size_mb * MB) // 4
    w = rng.standard_normal(count, dtype=np.float32) * np.float32(0.05)
    for _ in range(3):
        w -= np.float32(0.01) * rng.standard_normal(count, dtype=np.float32) * np.abs(w)
    return w.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else w


def codecs(threads: int) -> dict[str, tuple[Callable[[np.ndarray], bytes], Callable[[bytes, np.ndarray], object]]]:
    """name -> (encode array, decode blob for that array and take the plain CRC-32)."""
    import blosc2

    from weightstore.core import checksums as crc
    from weightstore.formats import _shuffle_zstd

    def ours_encode(array: np.ndarray) -> bytes:
        out = io.BytesIO()
        _shuffle_zstd.encode(array.view(np.uint8).data, array.dtype.itemsize, out)
        return out.getvalue()

    def ours_decode(blob: bytes, array: np.ndarray) -> object:
        return _shuffle_zstd.decode(memoryview(blob), array.dtype.itemsize, array.nbytes, "bench", "w")[1]

    def blosc(codec: blosc2.Codec, blocksize: int) -> tuple[Callable, Callable]:
        def encode(array: np.ndarray) -> bytes:
            return blosc2.compress2(array.view(np.uint8).data, typesize=array.dtype.itemsize, clevel=1, codec=codec,
                                    filters=[blosc2.Filter.SHUFFLE], blocksize=blocksize, nthreads=threads)

        def decode(blob: bytes, array: np.ndarray) -> object:
            plain = blosc2.decompress2(blob, nthreads=threads)
            return crc.crc32(memoryview(plain))

        return encode, decode

    return {
        "shuffle-zstd (ours)": (ours_encode, ours_decode),
        "blosc2 shuffle+zstd 1 MiB blocks": blosc(blosc2.Codec.ZSTD, 1 << 20),
        "blosc2 shuffle+zstd auto blocks": blosc(blosc2.Codec.ZSTD, 0),
        "blosc2 shuffle+lz4 auto blocks": blosc(blosc2.Codec.LZ4, 0),
    }


def speed(size_mb: float, rounds: int, threads: int) -> list[list[str]]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        array = trained(size_mb, dtype)
        found = {name: (encode(array), decode) for name, (encode, decode) in codecs(threads).items()}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in found}
        for index in range(rounds + 1):
            for name, (blob, decode) in found.items():
                start, cpu = time.perf_counter(), time.process_time()
                decode(blob, array)
                if index:
                    times[name].append((time.perf_counter() - start, time.process_time() - cpu))
        for name, (blob, _) in found.items():
            wall, cpu = (statistics.median(column) for column in zip(*times[name], strict=True))
            rows.append([f"{name}, {dtype}", f"{array.nbytes / len(blob):.3f}", f"{array.nbytes / wall / 1e9:.2f}",
                         f"{array.nbytes / cpu / 1e9:.2f}"])
    return rows


HOSTILE = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    sys.path[:0] = [sys.argv[2]]
    from benchmarks.codec_bench import codecs
    name, case = sys.argv[1], json.loads(sys.stdin.read())
    _, decode = codecs(1)[name]
    array = np.empty(case["nbytes"] // case["itemsize"], {1: np.uint8, 2: np.uint16, 4: np.uint32}[case["itemsize"]])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        got = decode(bytes.fromhex(case["blob"]), array)
        outcome = "same" if got == case["crc"] else "wrong"
    except Exception as exc:
        outcome = "raised"
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps([outcome, grew * 1024]))
""")


def hostile(cases: int) -> list[list[str]]:
    """Each codec's decoder on forged and damaged frames, one child process per frame."""
    import os
    import random

    import blosc2

    from weightstore.core import checksums as crc

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    array = trained(0.25, "float32")
    plain_crc = crc.crc32(array.view(np.uint8).data)
    rows = []
    for name, (encode, _) in codecs(1).items():
        blob = bytearray(encode(array))
        rng = random.Random(0)
        frames = []
        if name.startswith("blosc2"):  # the header's uncompressed size: claim 2 GiB
            forged = bytearray(blob)
            forged[4:8] = (2**31 - 64).to_bytes(4, "little")
            frames.append(bytes(forged))
            assert blosc2.get_cbuffer_sizes(bytes(forged))[0] == 2**31 - 64
        else:  # the header's data bytes and block count: claim 2 GiB
            forged = bytearray(blob)
            forged[16:24] = (2**31 - 64).to_bytes(8, "little")
            frames.append(bytes(forged))
        for _ in range(cases):
            damaged = bytearray(blob)
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(damaged)) if rng.random() < 0.5 else rng.randrange(min(64, len(damaged)))
                damaged[at] = rng.randrange(256)
            frames.append(bytes(damaged))
        counts = {"same": 0, "raised": 0, "wrong": 0, "killed": 0}
        most = 0
        for frame in frames:
            case = json.dumps({"blob": frame.hex(), "nbytes": array.nbytes, "itemsize": 4, "crc": plain_crc})
            done = subprocess.run([sys.executable, "-c", HOSTILE, name, root], input=case, capture_output=True,
                                  text=True, timeout=120)
            if done.returncode:  # a signal (negative), or an error outside the decode (out of memory)
                counts["killed"] += 1
                print(f"  {name}: frame {frames.index(frame)} ended the process with {done.returncode}: "
                      f"{done.stderr.strip().splitlines()[-1:] or ''}", file=sys.stderr)
                continue
            outcome, grew = json.loads(done.stdout.strip().splitlines()[-1])
            counts[outcome] += 1
            most = max(most, grew)
        rows.append([name, str(len(frames)), *(str(counts[k]) for k in ("raised", "wrong", "same", "killed")),
                     f"{most / MB:.0f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="blosc2's threads (ours: the shared helper + caller)")
    parser.add_argument("--hostile", type=int, default=40, help="damaged frames per codec")
    args = parser.parse_args(argv)
    try:
        import blosc2
    except ImportError:
        sys.exit("this benchmark needs blosc2: pip install '.[bench]' in your weightstore clone")
    print(machine_line() + f", blosc2 {blosc2.__version__}")
    print(f"\n{args.size_mb:g} MB trained-like tensor, median of {args.rounds} rounds\n")
    print(table(["codec", "ratio", "load GB/s (decode + CRC-32)", "GB per CPU-second"],
                speed(args.size_mb, args.rounds, args.threads)))
    print(f"\nhostile frames: a header claiming 2 GiB, then {args.hostile} damaged frames, each decoded alone\n")
    print(table(["codec", "frames", "raised", "wrong bytes", "decoded intact", "process killed", "most MB taken"],
                hostile(args.hostile)))


if __name__ == "__main__":
    main()
