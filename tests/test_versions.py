"""Versioned folders on local disk and memory://: publish, latest, follow, retention, faults."""

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import typer
from processes import fork_together, run_forked
from typer.testing import CliRunner

import weightstore as ws
from polling import wait_until
from weightstore import sync as versions
from weightstore.cli import sync as sync_cli
from weightstore.core.limits import MAX_POINTER_BYTES
from weightstore.io.folders import folder_for

ROOT = Path(__file__).resolve().parents[1]


def weights_at(step: int, n: int = 3) -> dict:
    """Every tensor carries the step, so a mixed read is visible at once."""
    return {f"layer_{i}/w": np.full((4,), step, np.float32) for i in range(n)}


def assert_whole(loaded: dict, step: int) -> None:
    assert sorted(loaded) == sorted(weights_at(step))
    for value in loaded.values():
        assert np.all(value == step), (step, value)


def files(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_publish_then_latest_round_trips(tmp_path):
    assert ws.latest(tmp_path) is None
    published = ws.publish(tmp_path / "run", weights_at(3), step=3, metadata={"loss": 0.5})
    found = ws.latest(tmp_path / "run")
    assert isinstance(found, ws.Version)
    assert (found.step, found.path, found.metadata) == (3, published.path, {"loss": 0.5})
    assert found.created == published.created and found.created.endswith("Z")
    assert_whole(ws.load(found), 3)
    with ws.open(found) as store:
        assert store.metadata == {"loss": 0.5}


def test_opening_the_latest_of_a_folder_without_versions_says_why_it_is_none(tmp_path):
    """``ws.open(ws.latest(folder))``, as the docs write it, before the first publish: the
    error says that the folder has no version yet and how to wait for one, not os.fsdecode's
    bare complaint about None."""
    torch_adapter = pytest.importorskip("weightstore.adapters.torch")
    import torch

    assert ws.latest(tmp_path) is None
    for read in (ws.open, ws.load, lambda v: torch_adapter.assign(torch.nn.Linear(2, 2), v)):
        with pytest.raises(ws.NotAPathError, match=r"not None \(ws.latest\(folder\) is None while the folder has "
                                                   r"no version yet: wait for one with ws.follow"):
            read(ws.latest(tmp_path))


def test_a_writer_given_none_is_told_a_path_was_expected_not_how_to_wait_for_a_version():
    """The hint about ``ws.latest`` being None before the first version fits readers only: a
    save or publish given None (a path variable never set) gets the plain message."""
    weights = {"a": np.zeros(2, np.float32)}
    writers = (lambda: ws.save(None, weights), lambda: ws.publish(None, weights, step=1),
               lambda: ws.publish_shard(None, weights, step=1, rank=0, world=1, attempt=0))
    for write in writers:
        with pytest.raises(ws.NotAPathError) as caught:
            write()
        assert str(caught.value) == "a path was expected, not None"


def test_a_file_object_given_as_a_path_is_told_weightstore_takes_names(tmp_path):
    """``ws.open(io.BytesIO(data))`` failed inside ``os.fsdecode`` ("expected str, bytes or
    os.PathLike object, not BytesIO"), naming nothing weightstore takes; readers and writers
    now say a path or URL was expected, and why a file object is none. The refusal is a
    WeightStoreError, as every bad input's, and still the TypeError code caught before."""
    ws.save(tmp_path / "w.npz", weights_at(1))
    with open(tmp_path / "w.npz", "rb") as handle:
        for call in (ws.open, ws.load, lambda f: ws.save(f, weights_at(1)), ws.latest, ws.follow,
                     lambda f: ws.publish(f, weights_at(1), step=1), ws.BackgroundPublisher):
            with pytest.raises(ws.NotAPathError,
                               match=r"^a path or URL was expected, not a file object \(BufferedReader\)"):
                call(handle)
            with pytest.raises(TypeError, match=r"^a path or URL was expected, not a file object \(BytesIO\)") as caught:
                call(io.BytesIO(b""))
            assert isinstance(caught.value, ws.WeightStoreError)
    with pytest.raises(ws.NotAPathError, match=r"^a path or URL was expected, not float$"):
        ws.open(3.5)


def test_a_file_object_given_as_a_path_is_told_what_to_pass_instead(tmp_path):
    """The refusal said why a file object is no path but not what to give: an open file is told
    its own name, which works as the path, and one with no name (``io.BytesIO``, ``os.fdopen``'s
    descriptor) to write its bytes to a file first."""
    path = tmp_path / "w.npz"
    ws.save(path, weights_at(1))
    with open(path, "rb") as handle:
        with pytest.raises(TypeError, match=rf"; pass its name instead: {re.escape(repr(str(path)))}$"):
            ws.load(handle)
        assert ws.load(handle.name).keys() == weights_at(1).keys()  # what the message says works
    with os.fdopen(os.open(path, os.O_RDONLY), "rb") as by_descriptor:
        for nameless in (io.BytesIO(path.read_bytes()), by_descriptor):
            with pytest.raises(TypeError, match=r"; write its bytes to a file and pass that file's name$"):
                ws.open(nameless)
    with pytest.raises(TypeError, match=r"; give the name of the file or folder to write$"):
        ws.save(io.BytesIO(), weights_at(1))


def test_hdf5_versions(tmp_path):
    version = ws.publish(tmp_path, weights_at(1), step=1, format="hdf5")
    assert version.path.endswith("step-000000000001.h5")
    assert_whole(ws.load(ws.latest(tmp_path)), 1)


@pytest.mark.parametrize("keep, kept", [(3, [4, 5, 6]), (1, [5, 6]), (None, [1, 2, 3, 4, 5, 6])])
def test_retention_keeps_latest_and_the_one_before(tmp_path, keep, kept):
    for step in range(1, 7):
        ws.publish(tmp_path, weights_at(step), step=step, keep=keep)
    entries = versions.list_versions(tmp_path)
    assert [e.step for e in entries] == kept
    assert [e.latest for e in entries] == [False] * (len(kept) - 1) + [True]


def test_steps_must_increase(tmp_path):
    ws.publish(tmp_path, weights_at(5), step=5)
    for step in (5, 4):
        with pytest.raises(ws.PublishError, match="steps must increase"):
            ws.publish(tmp_path, weights_at(step), step=step)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="step must be"):
            ws.publish(tmp_path, weights_at(1), step=bad)
    assert ws.latest(tmp_path).step == 5


def test_follow_starts_late_at_latest_resumes_and_times_out(tmp_path):
    for step in (1, 2, 3):
        ws.publish(tmp_path, weights_at(step), step=step)
    assert [v.step for v in ws.follow(tmp_path, poll=0.01, timeout=0.05)] == [3]
    assert [v.step for v in ws.follow(tmp_path, poll=0.01, timeout=0.05, after=3)] == []
    assert [v.step for v in ws.follow(tmp_path / "nothing-yet", poll=0.01, timeout=0.05)] == []


def test_follow_sees_each_new_version_once_in_order(tmp_path):
    """Step 0 taken before the publisher starts (a follower starts at ``LATEST``: one that looks
    after a fast publish pruned step 0, as on a tmpfs, rightly starts later), then each version
    it yields is whole, new and in order, up to the last."""
    ws.publish(tmp_path, weights_at(0), step=0)
    following = ws.follow(tmp_path, poll=0.002, timeout=60)
    first = next(following)
    seen = [first.step]

    def publisher():
        for step in range(1, 30):
            ws.publish(tmp_path, weights_at(step), step=step, keep=2)

    thread = threading.Thread(target=publisher)
    thread.start()
    assert_whole(ws.load(first), 0)  # pinned while the publisher prunes it
    for version in following:
        assert_whole(ws.load(version), version.step)
        seen.append(version.step)
        if version.step == 29:
            break
    following.close()
    thread.join()
    assert seen == sorted(set(seen)) and seen[0] == 0 and seen[-1] == 29


def test_follow_skips_versions_published_while_the_caller_was_busy(tmp_path):
    """What the README promises: not every version, the newest once the caller asks again."""
    ws.publish(tmp_path, weights_at(1), step=1)
    following = ws.follow(tmp_path, poll=0.01, timeout=0.5)
    assert next(following).step == 1
    for step in (2, 3, 4):  # the caller is busy with step 1
        ws.publish(tmp_path, weights_at(step), step=step)
    assert [version.step for version in following] == [4]


def test_yielded_version_is_pinned_until_the_iteration_moves_on(tmp_path):
    ws.publish(tmp_path, weights_at(1), step=1, keep=2)
    following = ws.follow(tmp_path, poll=0.01, timeout=0.2)
    pinned = next(following)
    for step in (2, 3, 4):  # prunes step 1 from the folder
        ws.publish(tmp_path, weights_at(step), step=step, keep=2)
    assert not os.path.exists(pinned.path)
    assert_whole(ws.load(pinned), 1)
    assert next(following).step == 4
    following.close()


def test_unpinned_version_pruned_away_says_retry(tmp_path):
    ws.publish(tmp_path, weights_at(1), step=1, keep=2)
    stale = ws.latest(tmp_path)
    for step in (2, 3):
        ws.publish(tmp_path, weights_at(step), step=step, keep=2)
    with pytest.raises(ws.VersionGoneError, match="read LATEST again and retry"):
        ws.load(stale)
    with pytest.raises(FileNotFoundError):  # the builtin a caller may already handle
        ws.open(stale)


def _pointer_nesting(field: str, depth: int) -> bytes:
    """A LATEST naming step 3 whose ``field`` nests ``depth`` deep: parsed, yet ``str()`` or
    ``json.dumps`` of it (``ws versions --json``) would raise RecursionError."""
    fields = {"format": "weightstore-latest", "version": 1, "step": 3, "file": "step-000000000003.npz",
              "created": "HERE" if field == "created" else "2026-01-01T00:00:00.000Z",
              "metadata": {"note": "HERE"} if field == "metadata" else {}}
    return json.dumps(fields).replace('"HERE"', "[" * depth + "]" * depth).encode()


@pytest.mark.parametrize("content", [b"", b"  \n", b"garbage\x00\xff", b'{"step": 3}', b"[1, 2]",
                                     _pointer_nesting("created", 500), _pointer_nesting("metadata", 500),
                                     _pointer_nesting("metadata", 101)])
def test_damaged_latest_is_a_clear_error_and_publish_repairs_it(tmp_path, content):
    ws.publish(tmp_path, weights_at(3), step=3)
    (tmp_path / "LATEST").write_bytes(content)
    with pytest.raises(ws.FormatError, match="LATEST is (empty|not a weightstore version pointer)") as caught:
        ws.latest(tmp_path)
    assert (caught.value.path, caught.value.key) == (str(tmp_path), None)
    with pytest.raises(ws.FormatError, match="LATEST"):
        next(ws.follow(tmp_path, timeout=0))
    with pytest.warns(UserWarning, match="LATEST"), pytest.raises(ws.PublishError, match="not after step 3"):
        ws.publish(tmp_path, weights_at(2), step=2)
    with pytest.warns(UserWarning, match="the next publish replaces it"):
        ws.publish(tmp_path, weights_at(4), step=4)
    assert ws.latest(tmp_path).step == 4


def test_latest_naming_a_missing_file(tmp_path):
    ws.publish(tmp_path, weights_at(3), step=3)
    os.unlink(ws.latest(tmp_path).path)
    with pytest.raises(ws.VersionGoneError):
        ws.load(ws.latest(tmp_path))
    with pytest.raises(ws.StoreNotFoundError, match="LATEST names .*step-000000000003.npz, which does not exist") as info:
        next(ws.follow(tmp_path, timeout=0))
    assert not isinstance(info.value, ws.VersionGoneError)  # not worth retrying


def test_memory_urls(tmp_path):
    folder = f"memory://weightstore-tests/{tmp_path.name}"
    for step in range(1, 5):
        ws.publish(folder, weights_at(step), step=step, keep=2, storage_options={"one_writer": True})
    version = ws.latest(folder)
    assert version.path == f"{folder}/step-000000000004.npz"
    assert_whole(ws.load(version), 4)
    assert [e.step for e in versions.list_versions(folder)] == [3, 4]
    assert [v.step for v in ws.follow(folder, poll=0.01, timeout=0.05, after=2)] == [4]


def test_a_storage_without_compare_and_swap_refuses_to_publish_before_writing(tmp_path):
    """memory:// (as gs://, az://) has no backend with conditional writes: a plain write of
    LATEST would let a publisher that lost a race move it backwards unseen, so a publish there
    is refused, before any upload, unless its caller vouches to be the folder's one writer."""
    import fsspec

    from weightstore.sharded import publish_shard

    folder = f"memory://weightstore-tests/{tmp_path.name}-no-cas"
    with pytest.raises(ws.PublishError, match=r"replacing LATEST needs a compare-and-swap.*'one_writer': True") as caught:
        ws.publish(folder, weights_at(1), step=1)
    assert caught.value.path == folder
    with pytest.raises(ws.PublishError, match="committing step 1 needs a compare-and-swap"):
        publish_shard(folder, weights_at(1), step=1, rank=0, world=1, attempt=0)
    assert not fsspec.filesystem("memory").exists(folder[len("memory://"):])  # not a byte written
    ws.publish(folder, weights_at(1), step=1, storage_options={"one_writer": True})
    assert ws.latest(folder).step == 1  # the option never reaches fsspec, and reading needs none


# --- a publisher killed at every stage -------------------------------------------------------

STAGES = ["locked", "cleaned", "version-temporary", "version-written", "latest-temporary",
          "latest-written", "pruning", "pruned"]
#: the stages whose killed publisher leaves a temporary, for a restart that gets its PID
RESTARTED_AT = ["version-temporary", "latest-temporary"]

KILLED_PUBLISHER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import weightstore as ws
    from weightstore.sync import _stages as stages
    folder, stage = sys.argv[1], sys.argv[2]
    def weights(step):
        return {f"layer_{i}/w": np.full((4,), step, np.float32) for i in range(3)}
    for step in (1, 2, 3):
        ws.publish(folder, weights(step), step=step, keep=2)
    def hook(name):
        if name == stage:
            os.kill(os.getpid(), signal.SIGKILL)
    stages.hook = hook  # the no-op each stage of a publish calls
    ws.publish(folder, weights(4), step=4, keep=2)
    sys.exit(3)  # the stage was never reached
""")


@pytest.fixture(scope="module")
def killed_at(tmp_path_factory):
    """The folder of a publisher SIGKILLed at each stage, by stage: the publishers run at once,
    forked from one interpreter that imported weightstore (``processes.fork_together``)."""
    folders = {stage: tmp_path_factory.mktemp(stage) for stage in STAGES}
    folders |= {f"restart-{stage}": tmp_path_factory.mktemp(f"restart-{stage}") for stage in RESTARTED_AT}
    publishers = fork_together("import numpy, weightstore", KILLED_PUBLISHER,
                               [[str(folder), stage.removeprefix("restart-")] for stage, folder in folders.items()],
                               [{**os.environ, "PYTHONPATH": str(ROOT)}] * len(folders), timeout=120)
    for publisher in publishers:
        assert publisher.returncode == -signal.SIGKILL, publisher.stderr
    return folders


@pytest.mark.parametrize("stage", STAGES)
def test_publisher_killed_at_each_stage(killed_at, stage):
    folder = killed_at[stage]
    version = ws.latest(folder)
    expected = 4 if STAGES.index(stage) >= STAGES.index("latest-written") else 3
    assert version.step == expected
    assert_whole(ws.load(version), expected)
    assert [v.step for v in ws.follow(folder, timeout=0)] == [expected]
    ws.publish(folder, weights_at(5), step=5, keep=2)
    assert files(folder) == [".publish.lock", "LATEST", f"step-00000000000{expected}.npz", "step-000000000005.npz"]


@pytest.mark.parametrize("stage", RESTARTED_AT)
def test_a_restart_whose_pid_the_killed_publisher_had_removes_its_temporaries(killed_at, stage):
    """Restarted on another node, or in a fresh container, a trainer often gets the PID of the one
    killed mid-write (a container's trainer is often PID 1): its temporary, as large as a
    version, must not outlive it for want of a dead PID."""
    folder = killed_at[f"restart-{stage}"]
    for name in os.listdir(folder):
        if ".wstmp-" in name:
            os.rename(folder / name, folder / re.sub(r"wstmp-\d+-", f"wstmp-{os.getpid()}-", name))
    assert any(".wstmp-" in name for name in files(folder))
    ws.publish(folder, weights_at(5), step=5, keep=2)
    assert files(folder) == [".publish.lock", "LATEST", "step-000000000003.npz", "step-000000000005.npz"]
    assert ws.latest(folder).step == 5


def test_a_publish_removes_only_the_temporaries_of_names_written_under_its_lock(tmp_path, monkeypatch):
    """The lock shuts out publishers only: a live ``ws.save`` beside the versions, or a sharded
    coordinator putting its index back after its commit, holds none, and its temporary (named by
    a live PID: this process's) must outlive another's publish. LATEST's and the intent's are a
    dead publisher's whatever PID they carry; where no lock is taken (no fcntl), nothing is."""
    from weightstore.io.files import temporary_beside
    from weightstore.io.folders import LocalFolder

    ws.publish(tmp_path, weights_at(1), step=1)
    live = [temporary_beside(tmp_path / name) for name in ("best.npz", "step-000000000009.wsindex")]
    locked = [temporary_beside(tmp_path / name) for name in ("LATEST", ".publishing")]
    for temporary in live + locked:
        temporary.write_bytes(b"partial")
    monkeypatch.setattr(LocalFolder, "locks", False)
    ws.publish(tmp_path, weights_at(2), step=2)
    assert all(temporary.exists() for temporary in live + locked)
    monkeypatch.setattr(LocalFolder, "locks", True)
    ws.publish(tmp_path, weights_at(3), step=3)
    assert all(temporary.exists() for temporary in live) and not any(t.exists() for t in locked)
    assert_whole(ws.load(ws.latest(tmp_path)), 3)


def test_a_trainer_restarted_from_an_older_checkpoint_publishes_once_its_step_passes_latest(tmp_path, caplog):
    """What docs/sync.md promises: the restarted run's publishes are refused (logged, counted, never
    raised) until its step passes the newest version's, which readers go on being given."""
    for step in (100, 200, 300):
        ws.publish(tmp_path, weights_at(step), step=step, keep=2)
    with ws.BackgroundPublisher(tmp_path, keep=2) as restarted:
        for step in (150, 250):
            restarted.publish(weights_at(step), step=step)
            assert restarted.wait(60) is None
        assert restarted.failures == 2 and "once its step passes 300" in str(restarted.last_error)
        assert "to serve its weights before that, publish to a new folder" in str(restarted.last_error)
        assert ws.latest(tmp_path).step == 300
        assert [v.step for v in ws.follow(tmp_path, timeout=0)] == [300]
        restarted.publish(weights_at(310), step=310)
        assert restarted.wait(60).step == 310
    assert "restarted from an older checkpoint" in caplog.text
    assert files(tmp_path) == [".publish.lock", "LATEST", "step-000000000300.npz", "step-000000000310.npz"]
    assert_whole(ws.load(ws.latest(tmp_path)), 310)


def test_killed_first_publish_leaves_nothing_a_reader_sees(tmp_path):
    script = KILLED_PUBLISHER.replace("for step in (1, 2, 3):", "for step in ():")
    result = run_forked(script, str(tmp_path), "version-written", timeout=60)  # a publisher process of its own
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert ws.latest(tmp_path) is None
    assert list(ws.follow(tmp_path, timeout=0)) == []
    # the complete step-4 file LATEST never named is kept (no LATEST: no version is deleted)
    with pytest.warns(UserWarning, match="LATEST is missing"):
        ws.publish(tmp_path, weights_at(5), step=5)
    assert files(tmp_path) == [".publish.lock", "LATEST", "step-000000000004.npz", "step-000000000005.npz"]
    assert ws.latest(tmp_path).step == 5


def test_missing_latest_keeps_versions_and_refuses_going_back(tmp_path):
    for step in (1, 2, 3):
        ws.publish(tmp_path, weights_at(step), step=step)
    temporary = tmp_path / ".step-000000000004.npz.wstmp-999999999-0123abcd"  # a dead writer's
    temporary.write_bytes(b"partial")
    os.unlink(tmp_path / "LATEST")
    assert ws.latest(tmp_path) is None
    for step in (1, 3):
        with (pytest.warns(UserWarning, match="LATEST is missing"),
              pytest.raises(ws.PublishError, match=f"step {step} is not after step 3, which is the newest version")):
            ws.publish(tmp_path, weights_at(step), step=step)
    kept = [f"step-00000000000{s}.npz" for s in (1, 2, 3)]
    assert files(tmp_path) == sorted([".publish.lock", temporary.name, *kept])
    with pytest.warns(UserWarning, match="LATEST is missing"):
        ws.publish(tmp_path, weights_at(4), step=4, keep=3)
    assert files(tmp_path) == [".publish.lock", "LATEST"] + [f"step-00000000000{s}.npz" for s in (2, 3, 4)]
    assert_whole(ws.load(ws.latest(tmp_path)), 4)


def test_publish_errors_name_the_version_file(tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(ws.InvalidKeyError, match=f"^{folder}/step-000000000001.npz: "):
        ws.publish(folder, {"bad//key": np.zeros(2, np.float32)}, step=1)
    with pytest.raises(ws.UnsupportedDTypeError, match=f"^{folder}/step-000000000001.npz: "):
        ws.publish(folder, {"w": np.array(["text"])}, step=1)
    assert not folder.exists()  # checked before anything is made


# --- a reader racing a publisher --------------------------------------------------------------

RACING_PUBLISHER = textwrap.dedent("""
    import sys
    import numpy as np
    import weightstore as ws
    folder, count = sys.argv[1], int(sys.argv[2])
    for step in range(1, count + 1):
        ws.publish(folder, {f"layer_{i}/w": np.full((4,), step, np.float32) for i in range(3)},
                   step=step, keep=2, metadata={"step": step})
""")


@pytest.mark.slow  # 500 publishes in a process of their own
def test_reader_racing_500_publishes_with_keep_2(tmp_path):
    ws.publish(tmp_path, weights_at(0), step=0, keep=2, metadata={"step": 0})
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    publisher = subprocess.Popen([sys.executable, "-c", RACING_PUBLISHER, str(tmp_path), "500"], env=env)
    loads = 0
    last = -1
    followed = []
    try:
        while True:
            done = publisher.poll() is not None
            version = ws.latest(tmp_path)
            if loads % 10 == 9:
                time.sleep(0.05)  # a slow reader: two publishes land and prune its version
            try:
                loaded = ws.load(version)
            except ws.VersionGoneError:  # pruned under the slow reader: look again
                continue
            assert_whole(loaded, version.step)
            assert version.metadata == {"step": version.step}
            assert version.step >= last
            last = version.step
            loads += 1
            for pinned in ws.follow(tmp_path, poll=0.001, timeout=0, after=followed[-1] if followed else None):
                assert_whole(ws.load(pinned), pinned.step)
                followed.append(pinned.step)
            if done:
                break
    finally:
        publisher.wait(timeout=120)
    assert publisher.returncode == 0
    assert last == 500 and followed[-1] == 500
    assert followed == sorted(set(followed))
    assert loads > 10, loads


# --- two publishers ---------------------------------------------------------------------------

TWO_PUBLISHERS = textwrap.dedent("""
    import json, sys
    import numpy as np
    import weightstore as ws
    folder = sys.argv[1]
    won, refused = [], []
    for step in range(1, 61):
        try:
            ws.publish(folder, {"w": np.full((4,), step, np.float32)}, step=step, keep=3)
            won.append(step)
        except ws.PublishError:
            refused.append(step)
    print(json.dumps(won))
""")


def test_two_publishers_steps_must_increase(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs = [subprocess.Popen([sys.executable, "-c", TWO_PUBLISHERS, str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=120)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    won = [json.loads(out) for out in outputs]
    assert not set(won[0]) & set(won[1]), "a step was published twice"
    assert ws.latest(tmp_path).step == 60
    assert np.all(ws.load(ws.latest(tmp_path))["w"] == 60)
    # LATEST passed from one to the other once at most: followers never got their models in turn
    owners = [owner for _, owner in sorted((step, n) for n, steps in enumerate(won) for step in steps)]
    assert sum(a != b for a, b in zip(owners, owners[1:], strict=False)) <= 1, won
    # a trainer restarted from an older checkpoint is refused until it passes the latest step
    with pytest.raises(ws.PublishError, match="another trainer"):
        ws.publish(tmp_path, {"w": np.zeros(4, np.float32)}, step=10)



SECOND_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    import weightstore as ws
    folder = sys.argv[1]
    for line in sys.stdin:  # a step to publish per line, each answered once done
        step = int(line)
        try:
            ws.publish(folder, {"w": np.full((4,), step, np.float32)}, step=step)
            print("published", flush=True)
        except ws.PublishError as error:
            print("refused:", error, flush=True)
""")


def test_a_second_live_trainer_takes_the_folder_over_and_the_first_is_refused(tmp_path):
    """Two live processes whose steps both go up: followers would serve their models in turn. The
    newer writer (a restarted run) publishes at once; the one it took over from is refused from then
    on, naming the folder and the other writer, and LATEST's writer changes once."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.Popen([sys.executable, "-c", SECOND_WRITER, str(tmp_path)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        def ask(step: int) -> str:
            first.stdin.write(f"{step}\n")
            first.stdin.flush()
            return first.stdout.readline()

        assert ask(1) == "published\n"
        ws.publish(tmp_path, weights_at(2), step=2)  # this process takes the folder over: its first publish there
        answer = ask(3)
        assert answer.startswith("refused:") and str(tmp_path) in answer, answer
        assert f"pid {os.getpid()}" in answer and f"pid {first.pid}" in answer and "step 2" in answer, answer
        assert "a notebook's restarted kernel too, takes the folder over" in answer, answer  # the way back
        assert ask(4).startswith("refused:")
        assert ws.latest(tmp_path).step == 2
        ws.publish(tmp_path, weights_at(5), step=5)  # the writer LATEST names goes on
        assert_whole(ws.load(ws.latest(tmp_path)), 5)
        assert first.communicate("", timeout=60)[1] is None and first.returncode == 0
    finally:
        first.kill()
        first.wait()
    with pytest.raises(ws.PublishError, match="another writer"):  # a third writer took over from this one
        subprocess.run([sys.executable, "-c", SECOND_WRITER, str(tmp_path)], env=env, text=True, input="6\n",
                       check=True, capture_output=True)
        ws.publish(tmp_path, weights_at(7), step=7)


STOPPED_WHILE_PUBLISHING = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import weightstore as ws
    from weightstore.sync import _stages as stages
    folder = sys.argv[1]
    ws.publish(folder, {"w": np.full((4,), 3, np.float32)}, step=3)
    # stopped (SIGSTOP: a node paused, a VM migrated) in the middle of its next publish
    stages.hook = lambda name: name == "version-temporary" and os.kill(os.getpid(), signal.SIGSTOP)
    ws.publish(folder, {"w": np.full((4,), 4, np.float32)}, step=4)
    stages.hook = None
    # its next publish comes after the restart's (a lock freed is not handed to the waiter first:
    # published at once, step 6 could take the lock back and the restart's step 5 be refused)
    deadline = time.monotonic() + 60
    while (ws.latest(folder) is None or ws.latest(folder).step < 5) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        ws.publish(folder, {"w": np.full((4,), 6, np.float32)}, step=6)
    except ws.PublishError as exc:
        sys.exit(f"refused: {exc}")
""")


def test_a_publish_waiting_on_a_stopped_publishers_lock_says_whose_it_waits_for(tmp_path, caplog):
    """A trainer stopped mid-publish holds the folder's lock, and its restart elsewhere waits for
    it: the wait is said (the holder's host and PID), and once the stopped one goes on, the
    restarted one takes the folder over and the stopped one's next publish is refused."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    stopped = subprocess.Popen([sys.executable, "-c", STOPPED_WHILE_PUBLISHING, str(tmp_path)], env=env,
                               stderr=subprocess.PIPE, text=True)
    outcome: list = []
    try:
        _, status = os.waitpid(stopped.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), stopped.stderr.read()
        restarted = threading.Thread(target=lambda: outcome.append(ws.publish(tmp_path, weights_at(5), step=5)))
        with caplog.at_level("WARNING", logger="weightstore"):
            restarted.start()
            wait_until(lambda: "waiting for its publish lock" in caplog.text, what="a publisher waiting for the lock",
                       every=0.05)
            assert f"pid {stopped.pid}" in caplog.text and "SIGSTOP" in caplog.text, caplog.text
            assert not outcome  # still waiting: the stopped publisher holds the lock
            os.kill(stopped.pid, signal.SIGCONT)
            restarted.join(60)
        _, error = stopped.communicate(timeout=60)
    finally:
        if stopped.poll() is None:
            stopped.kill()
            stopped.wait()
    assert outcome and outcome[0].step == 5 and "got its publish lock after waiting" in caplog.text
    assert stopped.returncode == 1 and "another writer" in error and "published step 5" in error, error
    assert_whole(ws.load(ws.latest(tmp_path)), 5)


@pytest.mark.parametrize("word", ["tf-checkpoint", "keras-preset", "keras", "weightstore-delta"])
def test_a_format_versions_are_never_written_in_is_refused_at_the_call(tmp_path, word):
    """``format="tf-checkpoint"`` (a TF user's guess) died on a bare IndexError in ws.publish, and
    a BackgroundPublisher took it and failed on its thread; ``"keras"`` said how ``ws import``
    writes an archive. Both name what a version is, before anything is written."""
    with pytest.raises(ws.FormatError, match=f"a version is an npz, safetensors or hdf5 file; format '{word}'"):
        ws.publish(tmp_path / "run", weights_at(1), step=1, format=word)
    with pytest.raises(ws.FormatError, match="a version is an npz, safetensors or hdf5 file"):
        ws.BackgroundPublisher(tmp_path / "run", format=word)
    assert not (tmp_path / "run").exists()


ANOTHER_USERS_LOCK = textwrap.dedent("""
    import sys

    import numpy as np

    import weightstore as ws

    print(ws.publish(sys.argv[1], {"w": np.ones(2, np.float32)}, step=2).step)
""")


def test_a_publish_into_a_folder_whose_lock_file_another_user_made_takes_the_lock_read_only(tmp_path):
    """Two users who both write a folder (a run restarted by a colleague): the first one's
    ``.publish.lock`` is 0644, which the second may not open for writing, and the publish died on a
    bare PermissionError. flock needs no write access: the lock is taken all the same."""
    ws.publish(tmp_path, {"w": np.zeros(2, np.float32)}, step=1)
    (tmp_path / ".publish.lock").chmod(0o444)  # as a file of another user's is to this one
    command = [sys.executable, "-c", ANOTHER_USERS_LOCK, str(tmp_path)]
    if os.geteuid() == 0:  # root writes any file; without the capabilities that let it, as a user would
        if shutil.which("setpriv") is None:
            pytest.skip("run as root, and no setpriv to drop the capabilities that skip permission checks")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0 and result.stdout.split() == ["2"], result.stderr
    assert ws.latest(tmp_path).step == 2


STOPPED_HOLDING_ANOTHER_USERS_LOCK = textwrap.dedent("""
    import os, signal, sys

    import numpy as np

    import weightstore as ws
    from weightstore.sync import _stages as stages

    stages.hook = lambda name: name == "version-temporary" and os.kill(os.getpid(), signal.SIGSTOP)
    print(ws.publish(sys.argv[1], {"w": np.ones(2, np.float32)}, step=2).step)
""")


KILLED_HOLDING_THE_LOCK = textwrap.dedent("""
    import os, signal, sys

    import numpy as np

    import weightstore as ws
    from weightstore.sync import _stages as stages

    ws.publish(sys.argv[1], {"w": np.zeros(2, np.float32)}, step=1)
    stages.hook = lambda name: name == "version-temporary" and os.kill(os.getpid(), signal.SIGKILL)
    ws.publish(sys.argv[1], {"w": np.ones(2, np.float32)}, step=2)
""")


@pytest.mark.parametrize("last", ["released", "killed"])
def test_a_publish_waiting_on_a_lock_its_holder_could_not_write_in_names_no_other_process(tmp_path, caplog, last):
    """A publisher holding ``.publish.lock`` read-only (another user's file) cannot write its name
    in it: a publish waiting for it said the lock was held by the last process that wrote the
    file (this very process, its publish long done; or one killed holding the lock), sending
    whoever read the warning after the wrong process. It says the holder does not say who."""
    if last == "released":
        ws.publish(tmp_path, {"w": np.zeros(2, np.float32)}, step=1)
        gone = os.getpid()
    else:
        killed = subprocess.run([sys.executable, "-c", KILLED_HOLDING_THE_LOCK, str(tmp_path)], timeout=120,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert killed.returncode == -signal.SIGKILL
        gone = int((tmp_path / ".publish.lock").read_text().split(" pid ")[1].split()[0])
    (tmp_path / ".publish.lock").chmod(0o444)  # as a file of another user's is to this one
    command = [sys.executable, "-c", STOPPED_HOLDING_ANOTHER_USERS_LOCK, str(tmp_path)]
    if os.geteuid() == 0:  # root writes any file; without the capabilities that let it, as a user would
        if shutil.which("setpriv") is None:
            pytest.skip("run as root, and no setpriv to drop the capabilities that skip permission checks")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    stopped = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    outcome: list = []
    try:
        _, status = os.waitpid(stopped.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), stopped.stderr.read()
        def publish() -> None:
            try:
                outcome.append(ws.publish(tmp_path, weights_at(3), step=3))
            except ws.PublishError as exc:  # released: this process published step 1, and the other took over
                outcome.append(exc)

        waiting = threading.Thread(target=publish)
        with caplog.at_level("WARNING", logger="weightstore"):
            waiting.start()
            wait_until(lambda: "waiting for its publish lock" in caplog.text, what="a publisher waiting for the lock",
                       every=0.05)
            said = caplog.text
            os.kill(stopped.pid, signal.SIGCONT)
            waiting.join(60)
        out, error = stopped.communicate(timeout=60)
    finally:
        if stopped.poll() is None:
            stopped.kill()
            stopped.wait()
    assert "waiting for its publish lock" in said, said
    assert f"pid {gone}" not in said and "held by a process that does not say who" in said, said
    assert stopped.returncode == 0 and out.split() == ["2"], error
    assert outcome and "got its publish lock after waiting" in caplog.text


HOLDING_THE_LOCK_ELSEWHERE = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import weightstore as ws
    from weightstore.sync import _stages as stages
    folder, alive_here = sys.argv[1], set(json.loads(sys.argv[2]))

    def hold(name):
        if name == "locked":  # its words are in the lock file: the test publishes, and waits
            print(os.getpid(), flush=True)
            sys.stdin.readline()

    while True:  # PIDs here count up from 2: the holder takes the first one that is dead in the test's namespace
        pid = os.fork()
        if pid == 0:
            if os.getpid() in alive_here:
                os._exit(3)
            stages.hook = hold
            ws.publish(folder, {"w": np.full((4,), 3, np.float32)}, step=3)
            os._exit(0)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 3:
            sys.exit(code)
""")


def test_a_lock_holder_in_another_pid_namespace_is_named(tmp_path, caplog):
    """A container sharing its host's name (``--uts=host``, as with ``--net=host``) has PIDs of
    its own: a publish waiting for its lock took the words of a holder there, naming a PID dead
    in its own namespace, for a dead holder's, and said the holder does not say who."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "-Upf", "--mount-proc", "true"],
                                                      capture_output=True).returncode:
        pytest.skip("no unshare, or unshare -Upf --mount-proc refused here (no unprivileged user namespaces)")
    alive_here = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    holder = subprocess.Popen(["unshare", "-Upf", "--mount-proc", sys.executable, "-c", HOLDING_THE_LOCK_ELSEWHERE,
                               str(tmp_path), json.dumps(alive_here)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    outcome: list = []
    try:
        pid = int(holder.stdout.readline())
        waiting = threading.Thread(target=lambda: outcome.append(ws.publish(tmp_path, weights_at(5), step=5)))
        with caplog.at_level("WARNING", logger="weightstore"):
            waiting.start()
            wait_until(lambda: "waiting for its publish lock" in caplog.text, what="a publisher waiting for the lock",
                       every=0.05)
            said = caplog.text
            holder.stdin.write("\n")
            holder.stdin.flush()
            waiting.join(60)
        assert holder.wait(60) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert f"held by {socket.gethostname()} pid {pid} (PID namespace " in said and "does not say who" not in said, said
    assert outcome and outcome[0].step == 5 and ws.latest(tmp_path).step == 5


def test_a_publish_whose_lock_cannot_be_opened_is_a_write_error_naming_the_folder(tmp_path):
    """A lock file the system will not open (a read-only file system, here a folder squatting on
    the name) was a bare OSError out of ws.publish, which no ``except WeightStoreError`` catches."""
    ws.publish(tmp_path, {"w": np.zeros(2, np.float32)}, step=1)
    (tmp_path / ".publish.lock").unlink()
    (tmp_path / ".publish.lock").mkdir()
    with pytest.raises(ws.WriteError, match=re.escape(f"{tmp_path}: cannot be locked (.publish.lock: Is a directory)")):
        ws.publish(tmp_path, {"w": np.ones(2, np.float32)}, step=2)
    assert ws.latest(tmp_path).step == 1


def test_a_publish_whose_lock_the_system_refuses_to_take_is_a_write_error_naming_the_folder(tmp_path, monkeypatch):
    """NFS emulates flock by POSIX locks, whose exclusive lock a read-only descriptor (another
    user's lock file) may not take: EBADF, where an ordinary folder's lock only ever waits. That
    fault, made here at the call, is a WriteError naming the folder, never a bare OSError."""
    import fcntl

    ws.publish(tmp_path, {"w": np.zeros(2, np.float32)}, step=1)

    def refused(fd, operation):
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", refused)
    with pytest.raises(ws.WriteError, match=re.escape(f"{tmp_path}: cannot be locked (.publish.lock: Bad file")):
        ws.publish(tmp_path, {"w": np.ones(2, np.float32)}, step=2)
    monkeypatch.undo()
    assert ws.latest(tmp_path).step == 1


@pytest.mark.parametrize("step", [3, 2], ids=["a later step", "the step the other writer published"])
def test_a_background_publisher_whose_folder_another_process_took_over_logs_and_counts_the_refusal(tmp_path, caplog,
                                                                                                   step):
    """The training loop is never raised into: the refusal is logged and counted (the snapshot's
    future raises), and followers go on being given the other writer's version. A snapshot of the
    very step the other process published is refused as well: that version holds the other's
    weights (it was returned as this publisher's own)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with ws.BackgroundPublisher(tmp_path) as publisher:
        publisher.publish(weights_at(1), step=1)
        assert publisher.wait(60).step == 1
        taking_over = subprocess.run([sys.executable, "-c", SECOND_WRITER, str(tmp_path)], env=env, text=True,
                                     input="2\n", capture_output=True, timeout=120)
        assert taking_over.stdout == "published\n", taking_over.stderr
        future = publisher.publish(weights_at(3), step=step)
        assert publisher.wait(60).step == 1  # the last version it published
        assert publisher.failures == 1 and "another writer" in str(publisher.last_error)
        with pytest.raises(ws.PublishError, match="another writer"):
            future.result()
    assert f"pid {taking_over_pid(tmp_path)}" in caplog.text
    assert ws.latest(tmp_path).step == 2 and np.all(ws.load(ws.latest(tmp_path))["w"] == 2)


def test_a_latest_restored_from_another_runs_backup_is_no_take_over(tmp_path):
    """Serving rolled back to an earlier run's version by restoring its LATEST: the live trainer's
    next step above the versions past LATEST is published and keeps them all, as before LATEST
    named its writer (it was refused for good, as if the earlier run had published after it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    earlier = subprocess.run([sys.executable, "-c", SECOND_WRITER, str(tmp_path)], env=env, text=True,
                             input="1\n2\n", capture_output=True, timeout=120)
    assert earlier.stdout == "published\npublished\n", earlier.stderr
    backup = (tmp_path / "LATEST").read_bytes()
    for step in (3, 4, 5):  # this run goes on from the earlier one's checkpoint
        ws.publish(tmp_path, weights_at(step), step=step, keep=None)
    (tmp_path / "LATEST").write_bytes(backup)
    with pytest.raises(ws.PublishError, match="steps 3, 4, 5 above it were published before"):
        ws.publish(tmp_path, weights_at(5), step=5, keep=None)
    ws.publish(tmp_path, weights_at(6), step=6, keep=None)
    assert [e.step for e in versions.list_versions(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert_whole(ws.load(ws.latest(tmp_path)), 6)


def test_a_folder_restored_whole_from_another_runs_backup_is_no_take_over(tmp_path):
    """The folder restored whole (rsync --delete): LATEST and the versions went back to an earlier
    run's step 2, this trainer's steps 3 to 5 gone with them. It was refused for good, told the
    earlier run had published step 2 after its step 5, which steps that increase never allow."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    earlier = subprocess.run([sys.executable, "-c", SECOND_WRITER, str(tmp_path / "backup")], env=env, text=True,
                             input="1\n2\n", capture_output=True, timeout=120)
    assert earlier.stdout == "published\npublished\n", earlier.stderr
    run = tmp_path / "run"
    shutil.copytree(tmp_path / "backup", run)
    for step in (3, 4, 5):
        ws.publish(run, weights_at(step), step=step)
    shutil.rmtree(run)
    shutil.copytree(tmp_path / "backup", run)
    ws.publish(run, weights_at(6), step=6)
    assert [e.step for e in versions.list_versions(run)] == [1, 2, 6]
    assert_whole(ws.load(ws.latest(run)), 6)


FORKED_SNAPSHOTS = textwrap.dedent("""
    import os, sys
    import numpy as np
    import weightstore as ws
    folder, weights = sys.argv[1], {"w": np.zeros(4, np.float32)}
    ws.publish(folder, weights, step=1)
    for step in (2, 3):  # each snapshot written by a child sharing the trainer's pages
        weights["w"][:] = step
        child = os.fork()
        if child == 0:
            ws.publish(folder, weights, step=step)
            os._exit(0)
        assert os.waitpid(child, 0)[1] == 0
    weights["w"][:] = 4
    ws.publish(folder, weights, step=4)  # the trainer's own weights again
    published, go_on = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:  # a child that goes on publishing after its parent did is refused
        ws.publish(folder, weights, step=5)
        os.write(published[1], b"5")
        os.read(go_on[0], 1)
        try:
            ws.publish(folder, weights, step=7)
        except ws.PublishError as error:
            print("child refused:", error, flush=True)
        os._exit(0)
    os.read(published[0], 1)
    weights["w"][:] = 6
    ws.publish(folder, weights, step=6)
    os.write(go_on[1], b"6")
    assert os.waitpid(child, 0)[1] == 0
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_a_trainer_publishing_from_forked_children_goes_on_publishing_itself(tmp_path):
    """Snapshots written by forked children (no copy of the weights), the first and later
    versions by the trainer: the children never take the folder from their parent (its next
    publish was refused for good), and a child publishing again after its parent is refused."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", FORKED_SNAPSHOTS, str(tmp_path)], env=env, text=True,
                            capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("child refused:") and "another writer" in result.stdout, result.stdout
    assert ws.latest(tmp_path).step == 6 and np.all(ws.load(ws.latest(tmp_path))["w"] == 6)


def taking_over_pid(folder) -> int:
    """The PID of the process LATEST says wrote it."""
    return int(json.loads((Path(folder) / "LATEST").read_text())["writer"].split(" pid ")[1].split()[0])


# --- CLI --------------------------------------------------------------------------------------

@pytest.fixture
def cli():
    """The sync commands on a bare app; ``ws`` resets the global options after each command, so this does too."""
    from weightstore.cli.render import settings

    app = typer.Typer()
    sync_cli.register(app)
    yield app
    settings.reset()


def test_cli_versions(tmp_path, cli):
    for step in (7, 8, 9):
        ws.publish(tmp_path, weights_at(step), step=step, keep=2)
    result = CliRunner().invoke(cli, ["versions", str(tmp_path)])
    assert result.exit_code == 0, result.output
    header, *lines = result.output.splitlines()
    assert header.split() == ["step", "written", "size", "kind", "file"]
    assert len(lines) == 2 and "step-000000000008.npz" in lines[0]
    assert lines[1].endswith("<- LATEST") and lines[1].split()[0] == "9"
    result = CliRunner().invoke(cli, ["versions", str(tmp_path), "--json"])
    document = json.loads(result.output)
    assert document["command"] == "versions" and document["ok"] is True
    rows = document["versions"]
    assert [(r["step"], r["latest"]) for r in rows] == [(8, False), (9, True)] and rows[0]["size"] > 0
    result = CliRunner().invoke(cli, ["versions", str(tmp_path / "missing")])
    assert isinstance(result.exception, ws.StoreNotFoundError)


def test_cli_follow(tmp_path, cli):
    for step in (1, 2):
        ws.publish(tmp_path, weights_at(step), step=step)
    result = CliRunner().invoke(cli, ["follow", str(tmp_path), "--timeout", "0.05", "--poll", "0.01"])
    assert result.exit_code == 0 and result.output.split() == ["2", str(tmp_path / "step-000000000002.npz")]
    result = CliRunner().invoke(cli, ["follow", str(tmp_path), "--after", "2", "--timeout", "0.05", "--json"])
    assert result.exit_code == 0 and result.stdout == ""  # what it waits for goes to stderr, out of the stream
    assert result.stderr == f"weightstore: following {tmp_path}: its latest version is step 2; waiting for a " \
                            "version above step 2\n"
    for args in (["versions", "--help"], ["follow", "--help"]):
        assert CliRunner().invoke(cli, args).exit_code == 0
    for poll in ("1e12", "nan"):  # no wait a thread can make: a usage error, not an internal one
        assert CliRunner().invoke(cli, ["follow", str(tmp_path), "--poll", poll]).exit_code == 2
    watch = versions.PointerWatch(folder_for(tmp_path), poll=3e9)  # 4x would be past what a wait takes
    assert watch.max_poll <= threading.TIMEOUT_MAX


@pytest.mark.parametrize("name", ["r\x1b[31mun", "r\nun", "r\u202eun"], ids=["escape", "newline", "right-to-left"])
def test_ws_follow_prints_a_folder_of_odd_characters_as_one_line_that_names_no_other_folder(tmp_path, name):
    """``ws follow`` printed a version's path raw: a terminal's escape sequence in the folder's name
    was stripped (click drops them from what goes to a pipe), and the line named ``run/…``, another
    folder a script would load; a newline made two lines of one version. Its control characters are
    escaped as every other command shows a path; ``--json`` gives the path exactly."""
    folder = tmp_path / name
    ws.publish(folder, weights_at(1), step=1)
    (tmp_path / "run").mkdir()  # the folder the stripped name named
    ws_follow = [sys.executable, "-m", "weightstore", "follow", str(folder), "--timeout", "0"]
    shown = subprocess.run(ws_follow, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [f"1\t{str(folder / 'step-000000000001.npz').encode('unicode_escape').decode()}"]
    exact = subprocess.run([*ws_follow, "--json"], capture_output=True, text=True, timeout=120)
    assert json.loads(exact.stdout)["path"] == str(folder / "step-000000000001.npz")


def test_ws_follow_of_a_folder_deleted_while_followed_says_so_and_takes_its_new_run(tmp_path):
    """A followed folder deleted (a run started over in it) was waited on in silence, which looks
    like a hang, and the new run's step 1, the step ``ws follow`` had printed last, was never
    printed: a server fed by it kept the old run's weights. The removal is said once; the new
    run's first version is printed, whatever its step."""
    folder = tmp_path / "run"
    ws.publish(folder, weights_at(1), step=1)
    following = subprocess.Popen([sys.executable, "-m", "weightstore", "follow", str(folder), "--poll", "0.02",
                                  "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert following.stdout.readline().split() == ["1", str(folder / "step-000000000001.npz")]
        shutil.rmtree(folder)
        said = following.stderr.readline()  # LATEST, or the folder too where it was gone by that look
        assert said.startswith(f"weightstore: following {folder}: ") and said.endswith(
            " was removed; waiting for a version to be published\n"), said
        ws.publish(folder, weights_at(2), step=1)  # the new run's first version
        assert following.stdout.readline().split() == ["1", str(folder / "step-000000000001.npz")]
        assert "step 1 was published anew" in following.stderr.readline()
    finally:
        following.kill()
        following.communicate(timeout=60)
    assert_whole(ws.load(ws.latest(folder)), 2)


def test_a_new_runs_damaged_version_at_the_step_last_taken_is_passed_over_once(tmp_path, caplog):
    """A followed folder deleted and made anew whose first version, at the step last taken, does
    not open: it is passed over with one warning, as any damaged version is. The follower kept
    taking it for a version published anew, and opened it and warned again at every look (here
    every 0.02 s; by default every 4 s, for as long as the run published nothing newer)."""
    folder, made = tmp_path / "run", tmp_path / "made"
    ws.publish(folder, weights_at(1), step=1)
    os.truncate(ws.publish(made, weights_at(2), step=1).path, 10)  # the new run's step 1, damaged
    taken: list[int] = []

    def follow() -> None:
        taken.extend(version.step for version in ws.follow(folder, poll=0.02, max_poll=0.02, timeout=2))

    following = threading.Thread(target=follow)
    with caplog.at_level("WARNING", logger="weightstore"):
        following.start()
        deadline = time.monotonic() + 30
        while not taken and time.monotonic() < deadline:
            time.sleep(0.01)
        shutil.rmtree(folder)
        while "was removed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        os.rename(made, folder)  # the new run, whole at once
        following.join(60)
    assert not following.is_alive() and taken == [1]
    assert "was removed" in caplog.text and caplog.text.count("passing over version 1") == 1, caplog.text


@pytest.mark.parametrize("planted", ["link-loop", "unreadable"])
def test_an_intent_record_that_cannot_be_opened_fails_no_reader_and_a_publish_names_it(tmp_path, planted):
    """``.publishing`` a link to itself (or another user's file this one may not read): ``ws verify``
    of the folder exited 2 on it, though no reader needs the record (readers go by ``LATEST``),
    and a FIFO, a folder or a link out of the folder there failed nothing. It is read as no
    intent, as those are: every version above ``LATEST`` is kept. A publish replaces an
    unreadable file; through a link it never writes, and says so."""
    folder = tmp_path / "run"
    ws.publish(folder, weights_at(1), step=1)
    intent = folder / ".publishing"
    if planted == "link-loop":
        intent.symlink_to(".publishing")
    else:
        intent.write_text("{}")
        intent.chmod(0)
    ws_verify = [sys.executable, "-m", "weightstore", "verify", str(folder)]
    if os.geteuid() == 0:  # root reads any file; without the capabilities that let it, as a user would
        if shutil.which("setpriv") is None:
            pytest.skip("run as root, and no setpriv to drop the capabilities that skip permission checks")
        ws_verify = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *ws_verify]
    verified = subprocess.run(ws_verify, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert verified.returncode == 0 and "step-000000000001.npz: ok" in verified.stdout, verified.stderr
    if planted == "link-loop":
        with pytest.raises(ws.TargetError, match=re.escape(f"{intent}: is a symbolic link")):
            ws.publish(folder, weights_at(2), step=2)
        intent.unlink()
    assert ws.publish(folder, weights_at(2), step=2).step == 2
    assert not intent.exists() and not intent.is_symlink()


def test_ws_follow_of_a_missing_folder_says_so_unless_told_to_wait(tmp_path):
    """The installed command: exit 1 naming the folder, not silence until --timeout (or forever)."""
    missing = tmp_path / "typo"
    ws_follow = [sys.executable, "-m", "weightstore", "follow", str(missing)]
    refused = subprocess.run([*ws_follow, "--timeout", "30"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and str(missing) in refused.stderr and "no such folder" in refused.stderr
    assert "--wait" in refused.stderr and "Traceback" not in refused.stderr
    waiting = subprocess.Popen([*ws_follow, "--wait", "--timeout", "5", "--poll", "0.05"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        ws.publish(missing, weights_at(3), step=3)  # the folder appears, with its first version
        out, err = waiting.communicate(timeout=120)
    finally:
        waiting.kill()
    assert waiting.returncode == 0, err
    assert out.split() == ["3", str(missing / "step-000000000003.npz")]


def test_ws_follow_of_an_empty_folder_says_once_that_it_waits_for_the_first_version(tmp_path):
    """An existing folder with nothing published yet is waited on, not in silence: a wrong path
    and a trainer that has not published look alike otherwise."""
    def ws_follow(folder):
        return subprocess.run([sys.executable, "-m", "weightstore", "follow", str(folder), "--timeout", "0.2",
                               "--poll", "0.05"], capture_output=True, text=True, timeout=120)

    empty = tmp_path / "empty"
    empty.mkdir()
    waited = ws_follow(empty)
    assert waited.returncode == 0 and waited.stdout == "", waited.stderr
    assert waited.stderr.count("waiting for its first version") == 1 and str(empty) in waited.stderr
    ws.publish(empty, weights_at(1), step=1)
    followed = ws_follow(empty)
    assert followed.stdout.split() == ["1", str(empty / "step-000000000001.npz")]
    assert "waiting" not in followed.stderr


def test_ws_follow_after_a_step_past_the_latest_says_once_what_it_waits_for(tmp_path):
    """``--after 1000`` where the newest version is step 3 waits for step 1001 on: said, not in silence."""
    for step in (1, 2, 3):
        ws.publish(tmp_path, weights_at(step), step=step)
    waited = subprocess.run([sys.executable, "-m", "weightstore", "follow", str(tmp_path), "--after", "1000",
                             "--timeout", "0.2", "--poll", "0.05"], capture_output=True, text=True, timeout=120)
    assert waited.returncode == 0 and waited.stdout == "", waited.stderr
    assert waited.stderr == (f"weightstore: following {tmp_path}: its latest version is step 3; waiting for a version "
                             "above step 1000\n")


def test_ws_follow_says_what_it_waits_for_as_a_status_line(tmp_path):
    """A status line as any: ``--quiet`` silences it, and a folder's name is escaped in it (a
    newline would split the one line a log reader splits on)."""
    folder = tmp_path / "run\nnext"
    ws.publish(folder, weights_at(3), step=3)
    follow = [sys.executable, "-m", "weightstore", "follow", str(folder), "--after", "1000", "--timeout", "0.2",
              "--poll", "0.05"]
    said = subprocess.run(follow, capture_output=True, text=True, timeout=120)
    assert said.returncode == 0 and said.stdout == "", said.stderr
    assert said.stderr == (f"weightstore: following {tmp_path}/run\\nnext: its latest version is step 3; waiting for "
                           "a version above step 1000\n")
    quiet = subprocess.run([*follow[:3], "-q", *follow[3:]], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and quiet.stdout == quiet.stderr == "", quiet.stderr


@pytest.mark.parametrize("command", ["versions", "follow"])
def test_cli_sync_help_shows_an_example(command):
    from weightstore.cli.main import app

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "Example:" in result.output and f"ws {command} " in result.output


def test_cli_versions_sizes_read_like_the_other_commands(tmp_path, cli):
    from weightstore.cli.render import human_bytes

    ws.publish(tmp_path, weights_at(1), step=1)
    entry = versions.list_versions(tmp_path)[0]
    result = CliRunner().invoke(cli, ["versions", str(tmp_path)])
    assert human_bytes(entry.size) in result.output


def test_a_version_and_its_file_record_one_created_time(tmp_path):
    """``ws follow --json`` shows the version's time, ``ws ls --json`` the file's: the same instant, in one form."""
    version = ws.publish(tmp_path / "run", {"w": np.ones(2, np.float32)}, step=1)
    with ws.open(version.path) as store:
        assert store.created == version.created == ws.latest(tmp_path / "run").created
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", version.created)


def with_created(path, created: str) -> None:
    """Rewrite npz file ``path`` with its manifest's ``created`` time replaced by ``created``."""
    with np.load(path) as loaded:
        members = {name: loaded[name] for name in loaded.files}
    manifest = json.loads(str(members["__weightstore__"]))
    members["__weightstore__"] = np.array(json.dumps({**manifest, "created": created}))
    with open(path, "wb") as handle:
        np.savez(handle, **members)


def test_latest_naming_a_file_another_publish_wrote_is_refused_but_a_file_of_an_older_weightstore_reads(tmp_path):
    """Readers take a version only where its file was written by the publish whose record LATEST
    holds (both record its created time): else one publisher's metadata would be served with
    another's weights. A file of a weightstore that recorded its time in seconds (+00:00) is no
    such file: it reads, and so does one written by hand without a time."""
    run = tmp_path / "run"
    version = ws.publish(run, {"w": np.ones(2, np.float32)}, step=1)
    with_created(run / "step-000000000001.npz", "2026-01-01T00:00:00.000Z")  # another publish's file
    with pytest.raises(ws.FormatError, match="written by another, at 2026-01-01T00:00:00.000Z") as caught:
        ws.load(ws.latest(run))
    assert caught.value.path == version.path
    for created in (version.created[:19] + "+00:00", ""):
        with_created(run / "step-000000000001.npz", created)
        assert ws.load(ws.latest(run))["w"].tolist() == [1, 1]


def test_a_pointer_naming_a_field_twice_is_refused(tmp_path):
    """Which ``step`` a JSON reader takes of two is its whim: a LATEST naming one twice is refused, not read either way."""
    run = tmp_path / "run"
    ws.publish(run, {"w": np.ones(2, np.float32)}, step=1)
    text = (run / "LATEST").read_text()
    (run / "LATEST").write_text(text.rstrip().removesuffix("}") + ', "step": 7}')
    with pytest.raises(ws.FormatError, match="LATEST is not a weightstore version pointer") as caught:
        ws.latest(run)
    assert caught.value.path == str(run)
    ws.publish(run, {"w": np.ones(2, np.float32)}, step=2)  # which a publish repairs
    assert ws.latest(run).step == 2


def test_metadata_as_dense_as_json_allows_reads_back_from_latest(tmp_path):
    """What publish writes into LATEST, every reader reads: dense metadata (a list of shapes) too."""
    shapes = [[i] for i in range(3000)]
    ws.publish(tmp_path / "run", {"w": np.ones(2, np.float32)}, step=1, metadata={"layer_shapes": shapes})
    assert ws.latest(tmp_path / "run").metadata["layer_shapes"] == shapes


# --- limits and damage a publisher or a follower meets -----------------------------------------

def test_metadata_that_would_make_latest_unreadable_is_refused_before_anything_is_written(tmp_path):
    """LATEST carries the metadata, JSON-escaped (é is 6 bytes there): past what readers read, the
    version would be published and never served."""
    run = tmp_path / "run"
    ws.publish(run, weights_at(1), step=1)
    big = {"notes": "é" * 200_000}  # 0.4 MB in the file, 1.2 MB in LATEST
    limit = rf"{MAX_POINTER_BYTES}"
    with pytest.raises(ws.SizeLimitError, match=rf"{run}/step-000000000002.npz: .*LATEST \d+ bytes.*{limit}"):
        ws.publish(run, weights_at(2), step=2, metadata=big)
    assert files(run) == [".publish.lock", "LATEST", "step-000000000001.npz"]
    ws.publish_shard(run, weights_at(2), step=2, rank=0, world=1, attempt=0)
    with pytest.raises(ws.SizeLimitError, match=rf"step-000000000002.wsindex: .*LATEST \d+ bytes.*{limit}"):
        ws.commit_shards(run, step=2, world=1, attempt=0, timeout=5, metadata=big)
    assert not [name for name in files(run) if name.endswith(".wsindex") or name == ".publishing"]
    assert ws.latest(run).step == 1
    ws.publish(run, weights_at(3), step=3, metadata={"notes": "é" * 1000})
    assert ws.latest(run).metadata == {"notes": "é" * 1000}


def test_a_latest_over_the_size_limit_says_so(tmp_path, cli):
    ws.publish(tmp_path, weights_at(1), step=1)
    pointer = (tmp_path / "LATEST").read_bytes()
    (tmp_path / "LATEST").write_bytes(pointer[:-1] + b" " * MAX_POINTER_BYTES + b"}")
    larger = f"LATEST is larger than {MAX_POINTER_BYTES} bytes"
    with pytest.raises(ws.FormatError, match=larger):
        ws.latest(tmp_path)
    with pytest.raises(ws.FormatError, match=larger):
        next(ws.follow(tmp_path, timeout=0))
    with pytest.warns(UserWarning, match=larger):
        ws.publish(tmp_path, weights_at(2), step=2)  # which repairs it
    assert ws.latest(tmp_path).step == 2


def test_a_huge_latest_on_a_generic_file_system_is_read_only_up_to_the_pointer_limit(tmp_path):
    """memory:// (as gs://, az://) goes through the generic fsspec backend: a hostile LATEST of
    megabytes is refused, and no more of it than the limit is ever read into memory."""
    from fsspec.implementations.memory import MemoryFileSystem

    from weightstore.io.fsspec_objects import BACKEND

    class Counting(MemoryFileSystem):  # shares memory://'s objects; counts the bytes read of them
        read = 0

        def cat_file(self, path, start=None, end=None, **kwargs):
            data = super().cat_file(path, start, end, **kwargs)
            Counting.read += len(data)
            return data

        def _open(self, path, mode="rb", **kwargs):
            handle = super()._open(path, mode, **kwargs)
            return Counted(handle) if mode == "rb" else handle

    class Counted:
        def __init__(self, handle):
            self._handle = handle

        def read(self, size=-1):
            data = self._handle.read(size)
            Counting.read += len(data)
            return data

        def __getattr__(self, name):
            return getattr(self._handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._handle.close()

    folder = f"memory://weightstore-tests/{tmp_path.name}-huge"
    ws.publish(folder, weights_at(1), step=1, storage_options={"one_writer": True})
    fs = Counting(skip_instance_cache=True)
    fs.pipe_file(f"/weightstore-tests/{tmp_path.name}-huge/LATEST", b" " * (8 << 20))
    with pytest.raises(ws.FormatError, match=f"LATEST is larger than {MAX_POINTER_BYTES} bytes"):
        ws.latest(folder)
    assert BACKEND.read_tagged(fs, f"/weightstore-tests/{tmp_path.name}-huge/LATEST", 1000) == (b" " * 1000, None)
    assert 0 < Counting.read <= 1000
    assert BACKEND.read_tagged(fs, f"/weightstore-tests/{tmp_path.name}-huge/none", 1000) == (None, None)
    fs.rm(f"/weightstore-tests/{tmp_path.name}-huge", recursive=True)


def test_follow_checks_its_words_when_called(tmp_path, cli):
    """``follow`` is a generator: a bad word must be refused by the call, not at the first ``next``
    (or never: a NaN timeout ended no wait)."""
    ws.publish(tmp_path, weights_at(1), step=1)
    for words, message in [({"timeout": float("nan")}, "timeout must be seconds"), ({"timeout": -1}, "timeout must"),
                           ({"after": "0"}, "after must be a non-negative int"), ({"after": 1.5}, "after must"),
                           ({"after": -1}, "after must"), ({"poll": float("nan")}, "poll must")]:
        with pytest.raises(ValueError, match=message):
            ws.follow(tmp_path, **words)
    assert [v.step for v in ws.follow(tmp_path, after=np.int64(0), timeout=0)] == [1]
    for words in (["--timeout", "nan"], ["--timeout", "-1"], ["--after", "-1"]):
        result = CliRunner().invoke(cli, ["follow", str(tmp_path), "--after", "1", "--poll", "0.01", *words])
        assert result.exit_code == 2, result.output


def test_notifications_take_the_region_from_the_queue_url(tmp_path, monkeypatch, cli):
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    run = f"memory://weightstore-tests/{tmp_path.name}-notified"  # only object storage sends notifications
    ws.publish(run, weights_at(1), step=1, storage_options={"one_writer": True})
    for queue in ("https://sqs.eu-west-1.amazonaws.com/123456789012/follower",
                  "https://eu-west-1.queue.amazonaws.com/123456789012/follower"):
        assert next(ws.follow(run, notifications=queue, timeout=0)).step == 1
    elsewhere = "http://127.0.0.1:9324/123456789012/follower"  # a local SQS: no region in its name
    with pytest.raises(ws.StorageError, match="set AWS_DEFAULT_REGION") as caught:
        ws.follow(run, notifications=elsewhere)
    assert caught.value.path == elsewhere
    result = CliRunner().invoke(cli, ["follow", str(run), "--timeout", "0", "--notifications", elsewhere])
    assert result.exit_code == 1 and "set AWS_DEFAULT_REGION" in str(result.exception)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert next(ws.follow(run, notifications=elsewhere, timeout=0)).step == 1


def test_notifications_for_a_local_folder_are_refused(tmp_path, cli):
    """No bucket sends events for a local folder: a queue there would never wake the follower,
    which would poll as if the option had been given in vain."""
    ws.publish(tmp_path, weights_at(1), step=1)
    queue = "https://sqs.eu-west-1.amazonaws.com/123456789012/follower"
    with pytest.raises(ValueError, match="is local"):
        ws.follow(tmp_path, notifications=queue)
    torch = pytest.importorskip("torch")
    from weightstore.adapters.serving.follower import Follower

    with pytest.raises(ValueError, match="is local"):
        Follower(torch.nn.Linear(1, 1), tmp_path, notifications=queue).start()
    result = CliRunner().invoke(cli, ["follow", str(tmp_path), "--timeout", "0", "--notifications", queue])
    assert result.exit_code == 2 and "is local" in re.sub(r"[│\s]+", " ", result.output)  # however rich wraps it


def test_versions_lists_a_folder_whose_latest_is_damaged(tmp_path, cli):
    """The listing is what one needs when LATEST is damaged: every version, none marked, and why."""
    for step in (1, 2, 3):
        ws.publish(tmp_path, weights_at(step), step=step)
    (tmp_path / "LATEST").write_bytes(b'{"format": "weightstore-latest", "step": 3, "fi')  # a torn copy
    damaged = "LATEST is not a weightstore version pointer"
    with pytest.warns(UserWarning, match=damaged):
        entries = versions.list_versions(tmp_path)
    assert [(entry.step, entry.latest) for entry in entries] == [(1, False), (2, False), (3, False)]
    result = CliRunner().invoke(cli, ["versions", str(tmp_path)])
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 1 + 3 and "LATEST" not in result.stdout
    assert damaged in result.stderr
    result = CliRunner().invoke(cli, ["versions", str(tmp_path), "--json"])
    document = json.loads(result.stdout)
    assert result.exit_code == 0 and [row["step"] for row in document["versions"]] == [1, 2, 3]
    assert damaged in document["latest_error"]
    with pytest.warns(UserWarning):
        ws.publish(tmp_path, weights_at(4), step=4)
    result = CliRunner().invoke(cli, ["versions", str(tmp_path), "--json"])
    assert json.loads(result.stdout)["latest_error"] is None


def test_follow_passes_over_a_damaged_version_and_yields_the_next(tmp_path, caplog, monkeypatch):
    """One damaged version (a truncated copy) must not end ``for version in ws.follow(...)`` for
    good: it is logged once and waited past, not opened again every poll."""
    ws.publish(tmp_path, weights_at(1), step=1)
    following = ws.follow(tmp_path, poll=0.02, timeout=10)
    assert next(following).step == 1
    damaged = ws.publish(tmp_path, weights_at(2), step=2)
    with open(damaged.path, "r+b") as handle:
        handle.truncate(100)
    opened = []
    pin = versions.Version.pin

    def counted(self, *args):
        opened.append(self.step)
        return pin(self, *args)

    monkeypatch.setattr(versions.Version, "pin", counted)
    threading.Timer(0.5, lambda: ws.publish(tmp_path, weights_at(3), step=3)).start()
    version = next(following)
    assert version.step == 3
    assert_whole(ws.load(version), 3)
    following.close()
    assert opened == [2, 3], opened  # the damaged one once, not again every look
    passed = [record for record in caplog.records if "step-000000000002.npz" in record.getMessage()]
    assert len(passed) == 1 and passed[0].levelname == "WARNING", caplog.text


def test_publish_refuses_what_no_folder_can_hold_naming_it(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ws.TargetError, match=f"^{tmp_path}/afile/run: "):
        ws.publish(tmp_path / "afile" / "run", weights_at(1), step=1)
    huge = tmp_path / "huge"
    for publish in (lambda: ws.publish(huge, weights_at(1), step=10**300),
                    lambda: ws.publish_shard(huge, weights_at(1), step=10**300, rank=0, world=1, attempt=0),
                    lambda: ws.commit_shards(huge, step=10**300, world=1, attempt=0, timeout=1)):
        with pytest.raises(ValueError, match="step .*too large"):
            publish()
    assert not huge.exists()
    from weightstore.sync._checks import _MAX_STEP_DIGITS

    longest = 10**_MAX_STEP_DIGITS - 1  # its name, written as a temporary first, fits the file system
    ws.publish(huge, weights_at(1), step=longest, format="safetensors")
    assert ws.latest(huge).step == longest
    with pytest.raises(ValueError, match="step .*too large"):
        ws.publish(huge, weights_at(1), step=longest + 1)


@pytest.mark.parametrize("kind", ["folder", "FIFO"])
def test_latest_naming_a_folder_or_fifo_says_what_it_is(tmp_path, kind):
    ws.publish(tmp_path, weights_at(1), step=1)
    squatter = tmp_path / "step-000000000002.npz"
    os.mkdir(squatter) if kind == "folder" else os.mkfifo(squatter)
    (tmp_path / "LATEST").write_text(json.dumps({"format": "weightstore-latest", "version": 1, "step": 2,
                                                 "file": squatter.name, "created": "", "metadata": {}}))
    with pytest.raises(ws.FormatError, match=f"^{squatter}: is a {kind}, not a file"):
        ws.load(ws.latest(tmp_path))


def test_a_latest_the_system_will_not_open_is_a_file_access_error_naming_it_everywhere(tmp_path):
    """A ``LATEST`` that is a symbolic link loop: latest, follow, publish and ``ws versions``
    name it with the system's reason; it leaked as a bare OSError."""
    ws.publish(tmp_path, weights_at(1), step=1)
    latest = tmp_path / "LATEST"
    latest.unlink()
    latest.symlink_to(latest.name)
    calls = {"latest": lambda: ws.latest(tmp_path), "follow": lambda: next(ws.follow(tmp_path, timeout=0)),
             "publish": lambda: ws.publish(tmp_path, weights_at(2), step=2)}
    for call in calls.values():
        with pytest.raises(ws.FileAccessError, match="symbolic links") as caught:
            call()
        assert caught.value.path == str(latest)
    from weightstore.cli.main import app

    result = CliRunner().invoke(app, ["versions", str(tmp_path)])
    assert result.exit_code == 1 and f"{latest}: cannot be opened" in result.output
    assert latest.is_symlink()  # nothing written through it or over it


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="Linux's /proc")
def test_a_latest_the_system_fails_to_read_is_a_storage_error_and_a_socket_a_file_access_error(tmp_path):
    """A LATEST whose read the system fails (EIO: a link to /proc/self/mem) is the storage's, a
    transient StorageError naming it (a bare OSError leaked); a socket in its place is the file's,
    a FileAccessError, never retried."""
    import socket

    ws.publish(tmp_path, weights_at(1), step=1)
    latest = tmp_path / "LATEST"
    latest.unlink()
    latest.symlink_to("/proc/self/mem")
    with pytest.raises(ws.StorageError, match="cannot be read") as caught:
        ws.latest(tmp_path)
    assert caught.value.path == str(latest) and caught.value.transient
    latest.unlink()
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(latest))
        with pytest.raises(ws.FileAccessError, match="cannot be opened") as refused:
            ws.latest(tmp_path)
    assert refused.value.path == str(latest)


def test_names_weightstore_never_writes_are_never_pruned_or_cleaned_as_versions_or_attempts(tmp_path):
    """Only ASCII digits and nothing after the name: ``\\d`` took Arabic-Indic digits and ``$`` a
    final newline, so a publish pruned, and ``ws clean`` removed, files and folders weightstore
    never wrote (a user's data beside the versions)."""
    ws.publish(tmp_path, weights_at(1), step=1)
    arabic_one = "\u0660" * 11 + "\u0661"
    squatters = ["step-000000000000.npz\n", f"step-{arabic_one}.npz"]
    for name in squatters:
        (tmp_path / name).write_bytes(b"the user's, not a version")
    folders = [f"step-{arabic_one}.attempt-0", "step-000000000000.attempt-0\n"]
    for name in folders:
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("the user's")
    ws.publish(tmp_path, weights_at(2), step=2, keep=1)
    ws.publish(tmp_path, weights_at(3), step=3, keep=1)
    ws.publish_shard(tmp_path, {"w": [ws.Piece(np.ones(2, np.float32), (0,), (2,))]}, step=4, rank=0, world=1,
                     attempt=0)
    ws.commit_shards(tmp_path, step=4, world=1, attempt=0, timeout=5)
    attempt = tmp_path / "step-000000000004.attempt-0"  # kept: its rank files no index names are swept
    squatters += [f"{attempt.name}/rank-00009.done\n", f"{attempt.name}/rank-\u0660\u0660\u0660\u0660\u0669.done"]
    for name in squatters[-2:]:
        (tmp_path / name).write_bytes(b"the user's, not a rank's")
    from weightstore.cli.main import app

    result = CliRunner().invoke(app, ["clean", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert all((tmp_path / name).is_file() for name in squatters)
    assert all((tmp_path / name / "mine.txt").is_file() for name in folders)
    assert 1 not in [version.step for version in versions.list_versions(tmp_path)]  # pruning ran


def test_following_a_folder_that_does_not_exist_says_so_once_and_waits(tmp_path, caplog):
    """A mistyped path waits for good, and the Python API, unlike ws follow, cannot refuse it (a
    server may start before its trainer's first publish): it says so once, and the first
    version to land is yielded."""
    folder = tmp_path / "run"
    following = ws.follow(folder, poll=0.01, timeout=30)
    missing = [record for record in caplog.records if "no such folder yet" in record.getMessage()]
    assert len(missing) == 1 and missing[0].levelname == "WARNING" and str(folder) in missing[0].getMessage()
    ws.publish(folder, weights_at(1), step=1)
    assert next(following).step == 1
    caplog.clear()
    assert next(ws.follow(folder, timeout=0)).step == 1
    assert "no such folder" not in caplog.text


def test_a_background_publish_whose_latest_swap_failed_after_it_landed_still_holds_the_folder(tmp_path, monkeypatch):
    """``LATEST``'s write raised after the storage had applied it (an answer lost on the way back):
    the publisher finds its own version there and takes it as published; the folder is then its
    own as after any publish, so a later take-over by another process refuses it (it took the
    folder back once, and followers switched models one time more)."""
    from weightstore.sync import _publish

    write_latest = _publish._write_latest

    def lost_answer(*args, **kwargs):
        write_latest(*args, **kwargs)
        monkeypatch.setattr(_publish, "_write_latest", write_latest)
        raise OSError(5, "EIO after the swap")

    monkeypatch.setattr(_publish, "_write_latest", lost_answer)
    with ws.BackgroundPublisher(tmp_path, retry_backoff=0.01) as publisher:
        assert publisher.publish(weights_at(1), step=1).result(60).step == 1
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        taking_over = subprocess.run([sys.executable, "-c", SECOND_WRITER, str(tmp_path)], env=env, text=True,
                                     input="2\n", capture_output=True, timeout=120)
        assert taking_over.stdout == "published\n", taking_over.stderr
        with pytest.raises(ws.PublishError, match="another writer"):
            publisher.publish(weights_at(3), step=3).result(60)
    assert ws.latest(tmp_path).step == 2


def fail_once_at(stage: str):
    """A stage hook that raises EIO the first time a publish reaches ``stage`` (a full disk, a
    storage that fails ``LATEST``'s write), and lets every later publish through."""
    failed = threading.Event()

    def hook(name: str) -> None:
        if name == stage and not failed.is_set():
            failed.set()
            raise OSError(5, f"EIO at {stage}")

    return hook


def test_a_first_publish_whose_latest_swap_failed_is_completed_by_its_retry(tmp_path, monkeypatch):
    """The first publish to a folder wrote its version, then failing to write ``LATEST`` left that
    file as the newest: the retry of the same step by the same process must publish it, not
    refuse it as "not after step 1" for good (a BackgroundPublisher retries storage failures)."""
    from weightstore.sync import _stages as stages

    monkeypatch.setattr(stages, "hook", fail_once_at("latest-temporary"))
    with ws.BackgroundPublisher(tmp_path / "background", retry_backoff=0.01) as publisher:
        assert publisher.publish(weights_at(1), step=1).result(60).step == 1
    assert publisher.failures == 1 and ws.latest(tmp_path / "background").step == 1
    assert files(tmp_path / "background") == [".publish.lock", "LATEST", "step-000000000001.npz"]

    monkeypatch.setattr(stages, "hook", fail_once_at("latest-temporary"))
    with pytest.raises(ws.WriteError, match="EIO at latest-temporary"):
        ws.publish(tmp_path / "plain", weights_at(1), step=1)
    ws.publish(tmp_path / "plain", weights_at(2), step=1)  # the retry's weights are the ones published
    assert_whole(ws.load(ws.latest(tmp_path / "plain")), 2)
    assert files(tmp_path / "plain") == [".publish.lock", "LATEST", "step-000000000001.npz"]


def _folder_calls(monkeypatch, folder) -> dict[str, list[str]]:
    """The listings of ``folder`` (``os.scandir``, ``os.listdir``) and the stats of files in it
    (``os.stat``, ``os.lstat``) this process makes from now on, each with the name it asked of."""
    calls: dict[str, list[str]] = {"list": [], "stat": []}
    root = os.fspath(folder)

    def counted(kind, real):
        def call(path=".", *args, **kwargs):
            text = os.fspath(path) if not isinstance(path, int) else ""
            if text.rstrip("/") == root:
                calls[kind].append(text)
            elif os.path.dirname(text) == root:
                calls[kind].append(os.path.basename(text))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "scandir", counted("list", os.scandir))
    monkeypatch.setattr(os, "listdir", counted("list", os.listdir))
    monkeypatch.setattr(os, "stat", counted("stat", os.stat))
    monkeypatch.setattr(os, "lstat", counted("stat", os.lstat))
    return calls


@pytest.mark.parametrize("keep", [None, 5])
def test_a_publish_lists_its_folder_once_and_stats_no_older_version_however_many(tmp_path, monkeypatch, keep):
    """A trainer keeping every version fills its folder with thousands: each publish lists the
    folder once (names only: no stat of each version, no time formatted for it), and stats none
    of the versions before it, so its cost does not grow with the folder (pruning included)."""
    run, seen = tmp_path / "run", {}
    for step in range(1, 31):  # a cost a version older adds shows 19 versions on as it would 49 on
        if step in (11, 30):
            calls = _folder_calls(monkeypatch, run)
            ws.publish(run, weights_at(step), step=step, keep=keep)
            seen[step] = calls
            monkeypatch.undo()
        else:
            ws.publish(run, weights_at(step), step=step, keep=keep)
    for calls in seen.values():
        assert len(calls["list"]) == 1, calls["list"]
        older = [name for name in calls["stat"] if name.startswith("step-") and name != "step-000000000030.npz"
                 and name != "step-000000000011.npz"]
        assert older == [], older
    assert len(seen[11]["stat"]) == len(seen[30]["stat"]), seen
    assert len([name for name in files(run) if name.startswith("step-")]) == (30 if keep is None else 5)
    assert_whole(ws.load(ws.latest(run)), 30)
