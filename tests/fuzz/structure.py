"""``python -m fuzz.structure TARGET SEED SECONDS`` (from ``tests/``): mutate a target's JSON, not its bytes.

Byte mutations of a JSON file mostly break its syntax, its seal or its section sizes, so few
reach the checks behind them; a hostile writer (or a bug) writes well-formed JSON that says
the wrong thing. This replaces one to three values of the seed's document (a delta version's
head or entries; a done-record, index, ``LATEST`` or Hugging Face index) by another value of
any type, a copy of another part, nothing, or a shifted number; writes it back with its sizes
and seal made anew (:attr:`fuzz.targets.Target.fixup`) and checks the target's property.
Every finding is printed and kept in the working folder. Where a fixup remakes a checksum
the writer's word decides what the file holds (a done-record that leaves a tensor out
commits a version without it), so only an escaped exception or a hang is a finding there.

Found with it: a delta version's metadata that no checksum covered (27,000 byte-level mutants
of ``./tasks fuzz`` had missed it), a Hugging Face index's dropped entry and ``"checksum": null``.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fuzz.targets import TARGETS, Finding, Session
from weightstore.formats import delta

VALUES: list[Any] = [None, True, 0, 1, -1, 2**31, 2**32, 2**62, 2**63, 2**64, -(2**63), 10**30, 1.5, -0.0, 1e308,
                     "", "x", "float32", "bfloat16", "same", "raw", "xor-zstd", "xor-top", "sparse", "step-000000000001.npz",
                     "../x.npz", "a/b", "\0", [], {}, [0], [[]], [0, 0], {"a": 1}, "0" * 100]


def _paths(document: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    items = document.items() if isinstance(document, dict) else enumerate(document) if isinstance(document, list) else ()
    for name, value in items:
        found += _paths(value, (*prefix, name))
    return found


def _at(document: Any, path: tuple) -> Any:
    for name in path:
        document = document[name]
    return document


def mutate(document: Any, rng: random.Random) -> Any:
    """A copy of ``document`` with one to three of its values replaced, copied, dropped or shifted."""
    document = copy.deepcopy(document)
    for _ in range(rng.randint(1, 3)):
        paths = [path for path in _paths(document) if path]
        if not paths:
            break
        path = rng.choice(paths)
        parent, name = _at(document, path[:-1]), path[-1]
        roll = rng.random()
        if roll < 0.5:
            parent[name] = copy.deepcopy(rng.choice(VALUES))
        elif roll < 0.7:
            parent[name] = copy.deepcopy(_at(document, rng.choice(paths)))
        elif roll < 0.8 and isinstance(parent, dict):
            del parent[name]
        elif roll < 0.9 and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[name]))
        elif type(parent[name]) in (int, float):
            parent[name] += rng.choice([-1, 1, 7, 2**32, -(2**32)])
    return document


def _sections(data: bytes) -> list[bytes]:
    """A delta version's head, entries and manifest, and its payloads."""
    text, at, sections = data.decode("latin-1"), delta._PREFIX.size, []
    for _ in range(3):
        end = json.JSONDecoder().raw_decode(text, at)[1]
        sections.append(data[at:end])
        at = end
    return [*sections, data[at:]]


def mutant(seed: bytes, rng: random.Random) -> bytes:
    """One mutant of ``seed``: a delta version's head or entries (its head has its manifest's CRC-32), or the whole document."""
    if seed.startswith(delta.MAGIC):
        sections = _sections(seed)
        which = rng.randrange(2)
        sections[which] = json.dumps(mutate(json.loads(sections[which]), rng)).encode()
        return delta._PREFIX.pack(delta.MAGIC, *map(len, sections[:3])) + b"".join(sections)
    return json.dumps(mutate(json.loads(seed), rng), separators=(",", ":")).encode()


def main(name: str, seed: int, seconds: float) -> dict[str, int]:
    folder = Path(tempfile.mkdtemp(prefix=f"fuzz-structure-{name}-"))
    session = Session(TARGETS[name], folder)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    end = time.monotonic() + seconds
    number = 0
    while time.monotonic() < end:
        number += 1
        data = mutant(session.seed, rng)
        try:
            outcome = session.check(data)
        except Finding as finding:
            kept = folder / f"finding-{number}"
            kept.write_bytes(data)
            print("FINDING", kept, finding, flush=True)
            outcome = "finding"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


if __name__ == "__main__":
    print(sys.argv[1], main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
