"""Coverage-guided fuzzing of the readers with atheris (libFuzzer), for as long as anyone wants.

``./tasks fuzz [--seconds N] [--target NAME ...]`` runs until interrupted (Ctrl-C) or for N
seconds. How long: a few minutes per target reach the shallow findings (leaked exceptions
on damaged fields); the classes that need structure to grow (prefix-sharing keys, deep
object graphs, many slices) need hours, so after changing a reader run its target alone
overnight (``./tasks fuzz --target tf-index --seconds 28800``), and every target for an hour
or more before a release. Each
input runs under a time limit (:data:`TIMEOUT_SECONDS`) and a memory limit
(:data:`RSS_LIMIT_MB`), so a hang or a runaway allocation is a finding too. It fuzzes the targets of :mod:`fuzz.targets` (the ones ``tests/test_fuzz.py`` runs
seeded): an input's first byte picks the target, the rest is that target's file. Whatever
breaks the property (an exception outside WeightStoreError, different arrays, a crash, a hang
or a runaway allocation) is copied to ``tests/data/regressions/`` as a file of that target,
which ``tests/test_bad_input.py`` then replays under limits in a subprocess; commit it with the
fix. The corpus grows in ``.fuzz/corpus/TARGETS`` and is reused by the next run of the same
targets (one corpus per set: an input's first byte picks among the targets run, so another set
would read it as another target's file).

The fuzzer runs in a child process, so that when a mutant kills it (SIGSEGV, libFuzzer's
timeout or memory limit) this parent still finds the file being read and keeps it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import pkgutil
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REGRESSIONS = ROOT / "tests" / "data" / "regressions"
WORK = ROOT / ".fuzz"
NAMES = ["npz", "npz-many", "npz-compressed", "hdf5", "numpy-savez", "latest", "safetensors", "tf-index",
         "tf-object-graph", "keras", "keras-config", "npz-numpy", "sharded-index", "delta", "delta-base",
         "sharded-done", "sharded-blocks", "sharded-member", "hf-index", "tf-data", "cli-delta",
         "sharded-delta", "mapping"]
#: per input: libFuzzer stops on an input that takes longer (a super-linear parse: 4,096 slices
#: took 10-20 s) or makes the process's memory pass this (a 200 KB index made 1.2 GB of keys)
TIMEOUT_SECONDS = 5
RSS_LIMIT_MB = 1024
#: the packages of weightstore the targets read through (all but the adapters, which no target uses)
READ_LAYERS = ["core", "io", "formats", "store", "sync", "sharded", "cli"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="./tasks fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=0, help="stop after this long (default: until Ctrl-C)")
    parser.add_argument("--target", action="append", choices=NAMES, help="fuzz only these (repeatable)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, libfuzzer = parser.parse_known_args(argv)
    names = args.target or NAMES
    if args.child:
        _fuzz(names, libfuzzer)
        return 0
    return _supervise(names, args.seconds)


def _supervise(names: list[str], seconds: int) -> int:
    corpus = WORK / "corpus" / "+".join(names)
    crashes = WORK / "crashes"
    for folder in (corpus, crashes):
        folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "fuzz.coverage", "--child", *sum((["--target", n] for n in names), []),
               str(corpus), f"-artifact_prefix={crashes}/", f"-timeout={TIMEOUT_SECONDS}", f"-rss_limit_mb={RSS_LIMIT_MB}",
               *([f"-max_total_time={seconds}"] if seconds else [])]
    try:
        result = subprocess.run(command, cwd=ROOT / "tests")
    except KeyboardInterrupt:
        return 0
    # done, or stopped by someone: libFuzzer catches SIGINT/SIGTERM and exits 72 (its
    # -interrupted_exitcode), which had kept the input being read as a regression that was none
    if result.returncode in (0, 72, -signal.SIGINT, -signal.SIGTERM):
        return 0
    kept = _keep_current(WORK / "work" / "+".join(names))
    print(f"fuzz: the fuzzer stopped (exit {result.returncode}); the input is kept as {kept}", file=sys.stderr)
    return 1


def _keep_current(work: Path) -> Path | None:
    """The file a crashed, hung or bloated child was reading, copied to the regressions."""
    marker = work / "KEPT"
    if marker.exists():  # the child kept it itself (an exception, or different arrays)
        return Path(marker.read_text())
    current = sorted(work.glob("**/mutant*")) + sorted(work.glob("*/versions/LATEST"))  # the latest target's
    if not current:
        return None
    source = current[0]
    data = source.read_bytes()
    suffix = source.suffix if source.name != "LATEST" else ".latest"
    target = REGRESSIONS / f"fuzz-{hashlib.sha256(data).hexdigest()[:12]}{suffix}"
    REGRESSIONS.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def _fuzz(names: list[str], libfuzzer: list[str]) -> None:
    import atheris  # the ``fuzz`` extra: pip install -e '.[fuzz]'

    # weightstore's own code and the targets', every module of the layers the targets read
    # through imported here: weightstore imports a format's reader (npz, HDF5, TF checkpoints,
    # sharded versions) at the first file of it, which after this block ran uninstrumented, its
    # branches unseen by the fuzzer (a TF2 object graph's parse reached 9 edges of the harness)
    with atheris.instrument_imports(include=["weightstore", "fuzz"]):
        for layer in READ_LAYERS:
            package = importlib.import_module(f"weightstore.{layer}")
            for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
                importlib.import_module(module.name)
        from fuzz.targets import TARGETS, Finding, Session
    # weightstore imports ml_dtypes at the first dtype name it does not know: 8 s on a busy
    # machine, which the per-input time limit would call a hang
    import ml_dtypes  # noqa: F401

    work = WORK / "work" / "+".join(names)  # one per set of targets: runs of other sets go on beside it
    shutil.rmtree(work, ignore_errors=True)
    sessions = []
    for name in names:
        folder = work / name
        folder.mkdir(parents=True)
        sessions.append(Session(TARGETS[name], folder))
    corpus = Path(libfuzzer[0]) if libfuzzer and not libfuzzer[0].startswith("-") else None
    if corpus is not None:
        for number, session in enumerate(sessions):
            (corpus / f"seed-{session.target.name}").write_bytes(bytes([number]) + session.seed)

    def one_input(data: bytes) -> None:
        if not data:
            return
        session = sessions[data[0] % len(sessions)]
        current = work / session.target.name / f"mutant{session.target.suffix}"
        if session.target.mutated is not None:  # a copy where a crash or hang leaves it for the parent
            current.write_bytes(data[1:])
        try:
            session.check(data[1:])
            current.unlink(missing_ok=True)
        except Finding as finding:
            suffix = session.target.suffix or ".latest"
            kept = REGRESSIONS / f"fuzz-{hashlib.sha256(data[1:]).hexdigest()[:12]}{suffix}"
            kept.write_bytes(data[1:])
            (work / "KEPT").write_text(str(kept))
            raise Finding(f"{session.target.name}: {finding} (kept as {kept})") from None

    atheris.Setup([sys.argv[0], *libfuzzer], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
