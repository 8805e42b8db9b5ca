"""SIGKILLs of the writers and the coordinator of sharded versions at every stage of the
protocol, with a follower checking every version it sees (real processes, a local folder and
the loopback S3 server).

Each round publishes one step: four writer processes and a coordinator, one of them SIGKILLed
at a stage of the publish (:data:`SCHEDULE` names every stage once, in the order each step's
tries meet them). A try that did not commit is retried as a job launcher would: the coordinator
alone with the same attempt when every rank's done-record is there, else every rank with the
next attempt. Meanwhile a ``ws.follow`` process checks that every version it sees holds exactly
what its step should, whole and read by thirds, and that steps never go back. At the end a step
left dead (a coordinator killed between its index and ``LATEST``, then a try missing a rank whose
coordinator and a writer are killed at a moment, not a stage) is removed by ``ws clean``, and the
folder holds only the versions ``LATEST`` reaches and their members.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shard_kills  # noqa: E402

import weightstore as ws  # noqa: E402
from polling import wait_until  # noqa: E402
from weightstore.formats._sharded_index import attempt_folder, done_name  # noqa: E402
from weightstore.io.folders import folder_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "weightstore-kills"
#: the kills of each step's tries, in turn (a try past its step's list kills none): every stage
#: of the protocol once. The coordinator's stages come first, each killing the coordinator the
#: last try left, until one after LATEST publishes; then a writer at each of its stages, each try
#: a new attempt (the last one's coordinator, finding every done-record, commits and is killed
#: while pruning step 1: four versions, keep=3)
SCHEDULE = [
    [{"coordinator": stage} for stage in ("index-written", "version-written", "latest-temporary", "locked",
                                          "cleaned", "latest-written")],
    [{"coordinator": "pruned"}],
    [{"writer-0": "member-temporary"}, {"writer-1": "member-written"},
     {"writer-3": "done-written", "coordinator": "pruning"}],
]
#: the most tries one step gets
TRIES = 8

pytestmark = pytest.mark.slow


class Launcher:
    """The launcher of ``shard_kills.py``: a process that imported weightstore once and forks each
    writer, coordinator and follower on request, so each starts in milliseconds. The test SIGKILLs
    them by pid itself; a child is reaped only when waited for, so its pid is never reused before.
    Their standard error goes to the file ``stderr``, read by :meth:`said`."""

    def __init__(self, stderr: Path):
        self.stderr, self.read = stderr, 0
        # one thread, so that forking is safe (see shard_kills.launch); a session of its own, so
        # that whatever a failed test leaves running is stopped with it. Appending: each child's
        # line lands whole
        with open(stderr, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("shard_kills.py"))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"})

    def _ask(self, *command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def start(self, role, *args):
        return self._ask(role, *args)

    def wait(self, pid):
        return self._ask("wait", pid)

    def said(self):
        """What the children wrote to standard error since the last call."""
        with open(self.stderr, "rb") as err:
            err.seek(self.read)
            text = err.read()
        self.read += len(text)
        return text.decode(errors="replace")

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # every child already gone: nothing to stop
                os.killpg(self.proc.pid, signal.SIGKILL)
            sys.stderr.write(self.stderr.read_text(errors="replace"))  # shown with a failed test's report


@pytest.fixture
def launcher(tmp_path):
    started = Launcher(tmp_path / "launched.stderr")
    yield started
    started.close()


def _done(folder, step, attempt):
    """Whether every rank of this try wrote its done-record (each after its whole member)."""
    names = {entry.name for entry in folder_for(f"{folder}/{attempt_folder(step, attempt)}").files()}
    return all(done_name(rank) in names for rank in range(shard_kills.WORLD))


def _try(launcher, folder, step, attempt, *, writers, plan):
    """One try at ``step``: the writers (if any) and a coordinator, killed per ``plan`` (at a
    stage, or after some seconds). A coordinator left waiting for a writer that died is stopped,
    as the job's launcher tearing the try down would. Returns each one's exit code (-9: killed),
    and the stage each one killed at a stage said it died at."""
    def stage_of(role):
        return plan.get(role) if isinstance(plan.get(role), str) else ""

    pids = {f"writer-{rank}": launcher.start("writer", folder, step, rank, attempt, stage_of(f"writer-{rank}"))
            for rank in range(writers)}
    pids["coordinator"] = launcher.start("coordinator", folder, step, attempt, stage_of("coordinator"))
    started = time.monotonic()
    for role, at in sorted(((role, at) for role, at in plan.items() if isinstance(at, float)), key=lambda kill: kill[1]):
        time.sleep(max(0.0, started + at - time.monotonic()))
        os.kill(pids[role], signal.SIGKILL)  # not reaped yet: the pid is still this child's
    codes = {role: launcher.wait(pid) for role, pid in pids.items() if role != "coordinator"}
    assert all(code in (0, -9) for code in codes.values()), codes
    if writers and not _done(folder, step, attempt):
        time.sleep(0.2)
        os.kill(pids["coordinator"], signal.SIGKILL)
    codes["coordinator"] = launcher.wait(pids["coordinator"])
    assert codes["coordinator"] in (0, -9, shard_kills.TIMED_OUT)
    said = shard_kills.said_killed(launcher.said())
    assert all(codes[role] == -9 and stage == stage_of(role) for role, stage in said.items()), (said, codes)
    return codes, said


def _published(folder, step):
    latest = ws.latest(folder)
    return latest is not None and latest.step == step


def run_rounds(launcher, folder, *, tmp_path):
    log, stop = tmp_path / "seen.jsonl", tmp_path / "stop"
    ws.publish(folder, shard_kills.expected(1), step=1, metadata={"step": 1})
    follower = launcher.start("follower", folder, str(log), str(stop))
    killed = []  # (role, stage) of each kill that took place, as the killed one said
    try:
        for step, plans in enumerate(SCHEDULE, start=2):
            attempt, writers = 0, shard_kills.WORLD
            for tried in range(TRIES):
                plan = plans[tried] if tried < len(plans) else {}
                _, said = _try(launcher, folder, step, attempt, writers=writers, plan=plan)
                killed += said.items()
                if _published(folder, step):
                    break
                if _done(folder, step, attempt):
                    writers = 0  # the coordinator alone, with the same attempt
                else:
                    attempt, writers = attempt + 1, shard_kills.WORLD
            else:
                pytest.fail(f"step {step} was not published in {TRIES} tries")
            assert tried >= len(plans) - 1, f"step {step} was published before its kill {plans[tried + 1]}"
        final = 1 + len(SCHEDULE)
        # a step left dead: a coordinator killed between its index and LATEST, and a try missing rank 3
        # whose coordinator and a writer are killed at a moment
        dead = final + 1
        _try(launcher, folder, dead, 0, writers=shard_kills.WORLD, plan={"coordinator": "index-written"})
        _try(launcher, folder, dead, 1, writers=3, plan={"coordinator": 0.0, "writer-0": 0.05})
        wait_until(lambda: log.exists() and f'["seen", {final}]' in log.read_text(),
                   what=f"the follower seeing step {final}", every=0.1)
    finally:
        stop.touch()
        code = launcher.wait(follower)
    reports = [json.loads(line) for line in log.read_text().splitlines()]
    errors = [value for kind, value in reports if kind == "error"]
    assert not errors, errors[0]
    assert code == 0
    seen = [value for kind, value in reports if kind == "seen"]
    assert seen == sorted(set(seen)) and seen[-1] == final and len(seen) >= 2, seen
    # every stage of the protocol met its kill
    assert sorted(stage for role, stage in killed if role == "coordinator") == sorted(shard_kills.COORDINATOR_STAGES)
    assert sorted(stage for role, stage in killed if role != "coordinator") == sorted(shard_kills.WRITER_STAGES)
    return final, dead


def check_clean(folder, final, dead):
    listed = folder_for(folder)
    before = set(listed.subfolders()) | {entry.name for entry in listed.files()}
    assert f"step-{dead:012d}.wsindex" in before and f"{attempt_folder(dead, 1)}" in before
    cleaned = subprocess.run([sys.executable, "-m", "weightstore", "clean", folder], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert cleaned.returncode == 0, cleaned.stderr
    after = set(listed.subfolders()) | {entry.name for entry in listed.files()}
    indexes = sorted(name for name in after if name.endswith(".wsindex"))
    members = sorted(name for name in after if ".attempt-" in name)
    assert f"step-{dead:012d}.wsindex" not in after and not any(f"step-{dead:012d}" in name for name in after)
    assert [name.split(".")[0] for name in indexes] == [name.split(".")[0] for name in members]  # one try each
    assert indexes[-1] == f"step-{final:012d}.wsindex" and len(indexes) <= 3  # keep=3
    version = ws.latest(folder)
    assert version.step == final
    shard_kills.check(folder, version)


def test_kills_of_writers_and_coordinator_at_every_stage_in_a_local_folder(launcher, tmp_path):
    folder = str(tmp_path / "run")
    final, dead = run_rounds(launcher, folder, tmp_path=tmp_path)
    check_clean(folder, final, dead)


def test_kills_of_writers_and_coordinator_at_every_stage_on_s3(server, launcher, tmp_path):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"  # the launcher's children reach the server by the environment
    final, dead = run_rounds(launcher, folder, tmp_path=tmp_path)
    check_clean(folder, final, dead)
