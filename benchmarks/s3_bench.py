"""Object storage: requests and bytes on the wire, weightstore against plain clients.

All in one process against moto's S3 server on 127.0.0.1 (:mod:`benchmarks.s3_server`), which
counts every request and every body byte it sends and receives. ``size_mb`` of float32 in 8
scopes of 8 tensors; for each, in the same run:

- ``weightstore`` npz and safetensors files: ``save``, ``open`` (index only), ``load`` of one
  scope (1/8 of the bytes) and of everything (checksums verified);
- ``s3fs + np.load``: the same npz file through ``s3fs.open`` (its default read-ahead cache)
  and ``np.load`` (lazy per member); save is ``np.savez`` into ``s3fs.open(..., "wb")``;
- ``safetensors bytes``: ``safetensors.numpy.load(fs.cat_file(...))`` (the library reads
  from bytes; there is no lazy remote open), save ``fs.pipe_file(save(weights))``.

The server is a CPU-bound Python process sharing this machine's cores with the client, so
the seconds say little about a real network: the request and byte counts are the result.
Ratios are to the weightstore row of the same format (lower is better for the other row).

    python -m benchmarks.s3_bench                  # 64 MB, 3 repetitions
    python -m benchmarks.s3_bench --size-mb 256
    python -m benchmarks.s3_bench --size-mb 64 --repeat 1   # with the 1/64 selective-load target
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

import weightstore as ws
from benchmarks.common import MB, fmt_ratio, fmt_seconds, machine_line, median, table
from benchmarks.s3_server import CountingS3, restore_environment, use_environment

BUCKET = "weightstore-bench"
SCOPES, PER_SCOPE = 8, 8


def _weights(size_mb: float) -> dict[str, np.ndarray]:
    count = max(1, int(size_mb * MB / 4 / (SCOPES * PER_SCOPE)))
    rng = np.random.default_rng(0)
    return {f"scope_{s}/tensor_{t}": rng.standard_normal(count, dtype=np.float32)
            for s in range(SCOPES) for t in range(PER_SCOPE)}


class _Cases:
    """The operations of one engine on one object; each returns what it loaded (or None)."""

    def __init__(self, fs: Any, url: str, weights: dict[str, np.ndarray]):
        self.fs, self.url, self.path, self.weights = fs, url, url[len("s3://"):], weights
        self.scope = [k for k in weights if k.startswith("scope_3/")]
        self.one = "scope_3/tensor_5"  # 1/64 of the bytes

    # weightstore
    def ws_save(self) -> None:
        ws.save(self.url, self.weights)

    def ws_open(self) -> None:
        ws.open(self.url).close()

    def ws_scope(self) -> dict:
        return ws.load(self.url, scope="scope_3")

    def ws_one(self) -> dict:
        return ws.load(self.url, include=[self.one])

    def ws_full(self) -> dict:
        return ws.load(self.url)

    # s3fs + np.load
    def np_save(self) -> None:
        with self.fs.open(self.path, "wb") as handle:
            np.savez(handle, **{k.replace("/", "__"): v for k, v in self.weights.items()})

    def np_open(self) -> None:
        with self.fs.open(self.path, "rb") as handle, np.load(handle) as archive:
            archive.files  # noqa: B018 - the directory is read here

    def np_read(self, keys: list[str]) -> dict:
        with self.fs.open(self.path, "rb") as handle, np.load(handle) as archive:
            names = {name.removesuffix(".npy").replace("__", "/"): name.removesuffix(".npy") for name in archive.files}
            return {key: archive[names[key]] for key in keys}

    # safetensors from bytes
    def st_save(self) -> None:
        import safetensors.numpy

        self.fs.pipe_file(self.path, safetensors.numpy.save(self.weights))

    def st_read(self, keys: list[str] | None) -> dict:
        import safetensors.numpy

        loaded = safetensors.numpy.load(self.fs.cat_file(self.path))
        return loaded if keys is None else {key: loaded[key] for key in keys}


def _measure(server: CountingS3, operation: Callable[[], Any], repeat: int) -> dict[str, float]:
    """Counts from the last repetition (they do not vary), the median of the seconds."""
    seconds = []
    for _ in range(repeat):
        server.reset()
        start = time.perf_counter()
        operation()
        seconds.append(time.perf_counter() - start)
    return {"requests": server.count(), "down": server.bytes_sent(), "up": server.bytes_received(),
            "seconds": median(seconds)}


def bench(size_mb: float = 64, repeat: int = 3) -> list[tuple[str, str, dict[str, float]]]:
    import s3fs

    server = CountingS3().start()
    saved = use_environment(server)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)
        weights = _weights(size_mb)
        total = sum(a.nbytes for a in weights.values())
        run = uuid.uuid4().hex
        npz = _Cases(fs, f"s3://{BUCKET}/{run}/w.npz", weights)
        plain = _Cases(fs, f"s3://{BUCKET}/{run}/plain.npz", weights)
        st = _Cases(fs, f"s3://{BUCKET}/{run}/w.safetensors", weights)
        theirs = _Cases(fs, f"s3://{BUCKET}/{run}/theirs.safetensors", weights)
        plan: list[tuple[str, str, Callable[[], Any]]] = [
            ("save", "weightstore npz", npz.ws_save),
            ("save", "s3fs + np.savez", plain.np_save),
            ("save", "weightstore safetensors", st.ws_save),
            ("save", "safetensors bytes", theirs.st_save),
            ("open", "weightstore npz", npz.ws_open),
            ("open", "s3fs + np.load", plain.np_open),
            ("open", "weightstore safetensors", st.ws_open),
            ("open", "safetensors bytes", lambda: theirs.st_read([])),
            ("load 1/8", "weightstore npz", npz.ws_scope),
            ("load 1/8", "s3fs + np.load", lambda: plain.np_read(plain.scope)),
            ("load 1/8", "weightstore safetensors", st.ws_scope),
            ("load 1/8", "safetensors bytes", lambda: theirs.st_read(theirs.scope)),
            ("load 1/64", "weightstore npz", npz.ws_one),
            ("load 1/64", "weightstore safetensors", st.ws_one),
            ("load all", "weightstore npz", npz.ws_full),
            ("load all", "s3fs + np.load", lambda: plain.np_read(list(weights))),
            ("load all", "weightstore safetensors", st.ws_full),
            ("load all", "safetensors bytes", lambda: theirs.st_read(None)),
        ]
        results = [(operation, engine, _measure(server, action, repeat)) for operation, engine, action in plan]
        _check(npz, st, weights)
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
        restore_environment(saved)
    _print(results, size_mb, total, repeat)
    selected = weights[npz.one].nbytes
    for operation, engine, r in results:
        if operation == "load 1/64":
            ratio = r["down"] / selected
            print(f"target: {engine} load of 1/64 <= 1.1x the selected bytes: {ratio:.3f}x "
                  f"({'yes' if ratio <= 1.1 else 'NO'}; {r['down'] / MB:.3f} MB down for {selected / MB:.3f} MB)")
    return results


def _check(npz: _Cases, st: _Cases, weights: dict[str, np.ndarray]) -> None:
    for cases in (npz, st):
        loaded = cases.ws_full()
        assert all(np.array_equal(loaded[k], v) for k, v in weights.items()), cases.url


def _print(results: list[tuple[str, str, dict[str, float]]], size_mb: float, total: int, repeat: int) -> None:
    baseline = {(op, engine.split()[1] if engine.startswith("weightstore") else ""): r
                for op, engine, r in results if engine.startswith("weightstore")}
    rows = []
    for operation, engine, r in results:
        fmt = "npz" if "np" in engine else "safetensors"
        ours = baseline[(operation, fmt)]
        is_ours = engine.startswith("weightstore")
        rows.append([operation, engine, str(int(r["requests"])), f"{r['down'] / MB:,.2f}", f"{r['up'] / MB:,.2f}",
                     fmt_seconds(r["seconds"]),
                     "" if is_ours else fmt_ratio(r["requests"] / max(ours["requests"], 1)),
                     "" if is_ours else fmt_ratio((r["down"] + r["up"]) / max(ours["down"] + ours["up"], 1))])
    print(f"S3 on loopback (moto): {size_mb:g} MB in {SCOPES}x{PER_SCOPE} float32 tensors ({total / MB:.1f} MB), "
          f"one scope {total / SCOPES / MB:.1f} MB; median of {repeat}. {machine_line()}")
    print("Seconds are CPU-bound on the in-process Python server: compare requests and MB, not time.")
    print(table(["operation", "engine", "requests", "MB down", "MB up", "seconds", "requests vs ws", "MB moved vs ws"],
                rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.s3_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=float, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    bench(args.size_mb, args.repeat)


if __name__ == "__main__":
    main()
