"""The three jobs end to end, on models built here: ``./tasks demo``.

1. Sync: a trainer publishes versions; an inference copy in another process follows them.
2. Ensembles: unscoped checkpoints loaded side by side under ``model_001``… in one graph,
   from Python and from the ``ws`` command.
3. Selective save/restore: trainable variables plus batch-norm statistics, no optimizer
   slots; a smaller file restored into a fresh model with identical predictions.

Each part is one of the examples beside this file; run any of them alone with
``python -m examples.NAME``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: keep its C++ start-up chatter out

import numpy as np  # noqa: E402

import weightstore as ws  # noqa: E402

PARTS = [
    ("The core: save, list without reading, load a selection", ["core_tour"]),
    ("Job 1 - sync: publish versions, follow them in another process", ["tf1_sync", "keras_sync"]),
    ("Job 2 - ensembles: unscoped checkpoints under model_001..model_003", ["tf1_ensemble", "keras_ensemble"]),
    ("Job 3 - selective save/restore: small files, other variables untouched", ["tf1_selective", "keras_selective"]),
]


def cli_ensemble(folder: Path) -> str:
    """The ensemble job from the shell: ``ws import m.npz --into ensemble.npz --scope model_00N``."""
    ensemble = folder / "ensemble.npz"
    for number in (1, 2, 3):
        member = folder / f"member_{number}.npz"
        ws.save(member, {"w": np.array([float(number)], np.float32)})
        _ws("import", str(member), "--into", str(ensemble), "--scope", f"model_00{number}")
    return _ws("ls", str(ensemble))


def _ws(*args: str) -> str:
    command = [sys.executable, "-m", "weightstore", *args]
    print("$ ws " + " ".join(args), flush=True)
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def main() -> None:
    started = time.monotonic()
    for title, names in PARTS:
        print(f"\n{'=' * 78}\n{title}\n{'=' * 78}", flush=True)
        for name in names:
            print(f"\n--- examples.{name} ---", flush=True)
            importlib.import_module(f"examples.{name}").main()
        if title.startswith("Job 2"):
            print("\n--- the same from the ws command ---", flush=True)
            with tempfile.TemporaryDirectory() as scratch:
                print(cli_ensemble(Path(scratch)), flush=True)
    print(f"\nAll three jobs ran in {time.monotonic() - started:.0f} s.")


if __name__ == "__main__":
    main()
