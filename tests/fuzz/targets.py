"""Entry points a fuzzer feeds bytes to, and the one property each must keep.

Each target writes the bytes where a user's file would be and reads them the way a user
would: open, list, describe and read every tensor with verification on (or, for a versions
folder, read its ``LATEST`` pointer). The property: the reader either raises a
:class:`~weightstore.errors.WeightStoreError` subclass, or returns exactly what the unmutated
file holds. Anything else (another exception, different arrays) is a finding.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import weightstore as ws


def sample_weights() -> dict[str, np.ndarray]:
    """Small, but with every feature a header describes: dtypes, 0-d, empty, nested and ``VALUE`` keys."""
    return {
        "dense/kernel": np.arange(48, dtype=np.float32).reshape(6, 8),
        "dense/bias": np.linspace(-1, 1, 8),
        "dense": np.array(3, dtype=np.int16),  # a key that is also a scope (HDF5 VALUE dataset)
        "emb": np.arange(5000, dtype=np.uint8).reshape(50, 100),  # compressible
        "flags": np.array([True, False, True]),
        "empty": np.zeros((0, 3), np.float16),
    }


@dataclass
class Target:
    """One file shape to fuzz: how to make its seed file, and where a mutant is written to be read."""

    name: str
    suffix: str
    make_seed: Callable[[Path], None]
    #: whether the format checks its manifest, so metadata too must read back unchanged (HDF5 keeps
    #: the manifest in an attribute no checksum covers: a changed metadata value reads as changed)
    checks_metadata: bool = True

    def seed(self, folder: Path) -> bytes:
        path = folder / f"seed-{self.name}{self.suffix}"
        self.make_seed(path)
        return path.read_bytes()


def many_weights() -> dict[str, np.ndarray]:
    """Enough small tensors (40) that a whole-file read takes the npz reader's batch path."""
    weights = {f"layer_{i:02d}/w": np.arange(i, i + 6, dtype=np.float32).reshape(2, 3) for i in range(36)}
    return weights | {k: v for k, v in sample_weights().items() if k != "emb"}


def _save_plain_numpy(path: Path) -> None:
    with open(path, "wb") as handle:  # np.savez would add ".npz" to a str path
        np.savez(handle, **{k.replace("/", "."): v for k, v in sample_weights().items()})


def _publish(folder: Path) -> None:
    folder.mkdir()
    ws.publish(folder, {"w": np.arange(4, dtype=np.float32)}, step=7)


def _commit_shards(path: Path) -> None:
    """A sharded version of two ranks beside ``path``, and its index copied to ``path``: a mutant
    index written beside it names the same members (a piece held by each rank, one whole tensor)."""
    kernel = sample_weights()["dense/kernel"]
    for rank in range(2):
        held = {"dense/kernel": ws.Piece(kernel[3 * rank:3 * rank + 3], (3 * rank, 0), kernel.shape)}
        if rank:
            held |= {k: v for k, v in sample_weights().items() if k != "dense/kernel"}
        ws.publish_shard(path.parent, held, step=1, rank=rank, world=2, attempt=0)
    version = ws.commit_shards(path.parent, step=1, world=2, attempt=0, timeout=10)
    path.write_bytes(Path(version.path).read_bytes())


TARGETS = {
    "npz": Target("npz", ".npz", lambda p: ws.save(p, sample_weights(), metadata={"lr": 0.5})),
    "npz-many": Target("npz-many", ".npz", lambda p: ws.save(p, many_weights())),
    "npz-compressed": Target("npz-compressed", ".npz", lambda p: ws.save(p, sample_weights(), compress=True)),
    "hdf5": Target("hdf5", ".h5", lambda p: ws.save(p, sample_weights(), metadata={"lr": 0.5}, compress=True),
                   checks_metadata=False),
    "numpy-savez": Target("numpy-savez", ".npz", _save_plain_numpy),
    "latest": Target("latest", "", _publish),
    # the index says nothing the members' block CRCs do not check, but its metadata is its own
    "sharded-index": Target("sharded-index", ".wsindex", _commit_shards, checks_metadata=False),
}


class Finding(AssertionError):
    """A mutant broke the property; the message says how."""


def read_file(path: Path) -> tuple[dict[str, np.ndarray], dict, bool]:
    """Everything a user can read from a weight file, verified, in memory it owns; and
    whether a manifest said what it holds."""
    with ws.open(path, verify=True) as store:
        together = store.read()  # many tensors at once: npz checks them as columns
        arrays = {}
        for key in store:
            store.info(key)
            arrays[key] = np.array(store[key])
            if together[key].tobytes() != arrays[key].tobytes() or together[key].dtype != arrays[key].dtype:
                raise Finding(f"tensor {key!r} reads differently alone and with the others")
        return arrays, dict(store.metadata), store.has_checksums


def check_file(path: Path, expected: tuple[dict[str, np.ndarray], dict, bool] | None, checks_metadata: bool) -> str:
    """Read a mutant; ``"refused"`` or ``"same"``, else raise :class:`Finding`.

    ``expected`` is what the seed file reads as; a mutant that reads must read as exactly that
    (same keys, dtypes, shapes, bytes and, where the format checks its manifest, the same
    metadata), keys in the same order. The exception, ``"unverified"``: an HDF5 file whose
    manifest attribute was destroyed (its name damaged) is a plain HDF5 file, read as one
    (``Store.has_checksums`` is False), and format version 1 has nothing to tell the two apart;
    npz cannot get there (its manifest member is CRC-checked and named twice).
    """
    try:
        arrays, metadata, has_manifest = read_file(path)
    except ws.WeightStoreError:
        return "refused"
    except Exception as exc:
        raise Finding(f"{type(exc).__name__} escaped: {exc}") from exc
    if expected is not None:
        want, want_metadata, seed_has_manifest = expected
        if seed_has_manifest and not has_manifest:
            return "unverified"  # an HDF5 file whose manifest attribute is gone is a plain HDF5 file
        order = list if has_manifest else sorted
        if order(arrays) != order(want):
            raise Finding(f"read keys {sorted(arrays)[:5]} instead of {sorted(want)[:5]}")
        for key, value in arrays.items():
            original = want[key]
            if value.dtype != original.dtype or value.shape != original.shape or value.tobytes() != original.tobytes():
                raise Finding(f"tensor {key!r} read as {value.dtype} {value.shape}, differing from the original")
        if checks_metadata and metadata != want_metadata:
            raise Finding(f"metadata read as {metadata!r} instead of {want_metadata!r}")
    return "same"


def check_latest(folder: Path) -> str:
    """``latest`` on a folder whose ``LATEST`` holds the mutant: a Version, None or a WeightStoreError."""
    try:
        version = ws.latest(folder)
    except ws.WeightStoreError:
        return "refused"
    except Exception as exc:
        raise Finding(f"{type(exc).__name__} escaped: {exc}") from exc
    if version is not None and not isinstance(version, ws.Version):
        raise Finding(f"latest returned {version!r}")
    return "same"


class Session:
    """A target's seed, made once in ``folder``, and the check of each mutant against it."""

    def __init__(self, target: Target, folder: Path):
        self.target = target
        if target.name == "latest":
            self.where = folder / "versions"
            target.make_seed(self.where)
            self.seed = (self.where / "LATEST").read_bytes()
            self.expected = None
        else:
            self.where = folder
            self.seed = target.seed(folder)
            self.expected = read_file(folder / f"seed-{target.name}{target.suffix}")

    def check(self, data: bytes) -> str:
        """Write ``data`` where the target's file goes and check it; :class:`Finding` if it breaks the property."""
        if self.target.name == "latest":
            (self.where / "LATEST").write_bytes(data)
            return check_latest(self.where)
        path = self.where / f"mutant{self.target.suffix}"
        path.write_bytes(data)
        try:
            return check_file(path, self.expected, self.target.checks_metadata)
        finally:
            os.unlink(path)


def fuzz_batch(name: str, seed: int, count: int, folder: Path, *, log=None) -> dict[str, int]:
    """``count`` seeded mutants of target ``name``; outcome -> how many.

    A mutant that breaks the property is kept as ``folder/finding-NAME-N`` and raised as a
    :class:`Finding` naming it; ``log`` (a text stream) gets a line before each mutant, so a
    process that dies on one leaves its number behind.
    """
    session = Session(TARGETS[name], folder)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for number in range(count):
        mutant = mutate(session.seed, rng)
        kept = folder / f"finding-{name}-{number}{session.target.suffix or '.latest'}"
        if log is not None:
            kept.write_bytes(mutant)
            print("START", number, kept, file=log, flush=True)
        try:
            outcome = session.check(mutant)
        except Finding as finding:
            kept.write_bytes(mutant)
            raise Finding(f"{name} mutant {number} (kept as {kept}): {finding}") from None
        if log is not None:
            kept.unlink()
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


# -- mutations -------------------------------------------------------------------------------

_INTERESTING = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, ord("0"), ord("9"), ord("{"), ord("[")]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to three of: bit flips, interesting bytes, truncation, insertion, deletion, splice."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        if not out:
            out += bytes([rng.randrange(256)])
            continue
        at = rng.randrange(len(out))
        kind = rng.choices(range(6), weights=(4, 3, 1, 1, 1, 1))[0]  # truncation alone ends most reads early
        if kind == 0:
            out[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            out[at] = rng.choice(_INTERESTING)
        elif kind == 2:
            del out[rng.randrange(len(out)) :]
        elif kind == 3:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == 4:
            del out[at : at + rng.randint(1, 64)]
        else:
            start = rng.randrange(len(out))
            chunk = bytes(out[start : start + rng.randint(1, 256)])
            out[at : at + len(chunk)] = chunk
    return bytes(out)
