"""BackgroundPublisher: publish without waiting for the write, one pending at most, failures never raised."""

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import weightstore as ws
from weightstore import sync as versions
from weightstore.sync import _stages as stages


def weights(step: int) -> dict:
    return {"dense/kernel": np.full((3, 2), step, np.float32), "dense/bias": np.arange(2, dtype=np.int64) + step}


@pytest.fixture
def gate(monkeypatch):
    """Holds every publish at its "locked" stage until ``gate.set()`` (at most 60 s)."""
    opened = threading.Event()
    held = []

    def stage(name: str) -> None:
        if name == "locked":
            held.append(threading.current_thread())
            opened.wait(60)

    monkeypatch.setattr(stages, "hook", stage)
    opened.held = held
    yield opened
    opened.set()


class Lazy:
    """An array-like (as framework tensors are) that records which thread converts it."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype
        self.converted_on: list[threading.Thread] = []

    def __array__(self, dtype=None, copy=None):
        self.converted_on.append(threading.current_thread())
        return self.array


def test_publish_returns_before_the_write_and_result_gives_the_version(tmp_path, gate):
    with ws.BackgroundPublisher(tmp_path, keep=None, metadata={"run": "a"}) as publisher:
        future = publisher.publish(weights(1), step=1, metadata={"epoch": 0})
        assert not future.done() and publisher.busy and ws.latest(tmp_path) is None
        gate.set()
        version = future.result()
        assert version.step == 1 and version.metadata == {"run": "a", "epoch": 0}
        assert publisher.last == version and not publisher.busy
    assert gate.held and gate.held[0] is not threading.current_thread()
    loaded = ws.load(ws.latest(tmp_path))
    for key, value in weights(1).items():
        np.testing.assert_array_equal(loaded[key], value)
        assert loaded[key].dtype == value.dtype


def test_a_publish_never_waits_and_a_newer_one_replaces_the_pending_one(tmp_path, gate):
    publisher = ws.BackgroundPublisher(tmp_path, keep=None)
    first = publisher.publish(weights(1), step=1)
    while not gate.held:  # until it is being written, held at its "locked" stage
        time.sleep(0.01)
    second = publisher.publish(weights(2), step=2)  # returns at once: pending
    third = publisher.publish(weights(3), step=3)  # replaces the pending one
    assert not first.done() and second.cancelled() and not third.done()
    gate.set()
    assert first.result(60).step == 1 and third.result(60).step == 3
    assert publisher.close().step == 3
    assert [entry.step for entry in versions.list_versions(tmp_path)] == [1, 3]
    np.testing.assert_array_equal(ws.load(ws.latest(tmp_path))["dense/kernel"], weights(3)["dense/kernel"])


def test_tensors_are_converted_on_the_publishing_thread(tmp_path):
    lazy = {key: Lazy(value) for key, value in weights(3).items()}
    with ws.BackgroundPublisher(tmp_path) as publisher:
        publisher.publish(lazy, step=3)
    for value in lazy.values():
        assert len(value.converted_on) == 1 and value.converted_on[0] is not threading.current_thread()
    np.testing.assert_array_equal(ws.load(ws.latest(tmp_path))["dense/kernel"], weights(3)["dense/kernel"])


@pytest.mark.skipif(sys.platform != "linux", reason="threads have a priority of their own on Linux")
def test_the_publishing_thread_yields_the_cores_to_training(tmp_path, monkeypatch):
    """It runs below the process's priority, and its hashing stays on it rather than on the
    shared helper (which runs at the process's priority); the training thread keeps its own."""
    from weightstore.core import _parallel

    seen = []

    class Priority(Lazy):
        def __array__(self, dtype=None, copy=None):
            seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), _parallel._alone()))
            return super().__array__(dtype, copy)

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ws.BackgroundPublisher(tmp_path) as publisher:
        publisher.publish({key: Priority(value) for key, value in weights(3).items()}, step=3).result(60)
    assert seen and all(priority > own or priority == 19 for priority, _ in seen)
    assert all(alone for _, alone in seen)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own and not _parallel._alone()


def test_the_snapshot_is_let_go_once_its_publish_is_done(tmp_path, gate):
    """Held while it may be written again (a retry writes the same weights), and not a moment
    longer: the publisher keeps no reference to a published snapshot."""
    array = np.ones((512, 1024), np.float32)
    held = weakref.ref(array)
    with ws.BackgroundPublisher(tmp_path) as publisher:
        future = publisher.publish({"t": array}, step=1)
        del array
        assert held() is not None  # pending: the publisher holds it
        gate.set()
        future.result(60)
    del future
    assert held() is None
    assert ws.load(ws.latest(tmp_path))["t"].sum() == 512 * 1024


@pytest.mark.slow  # eight publishes of 16 MB under tracemalloc
def test_a_failed_attempt_holds_neither_its_snapshot_nor_its_delta_once_a_retry_published(tmp_path):
    """``last_error`` stays after an outage ends, and its traceback held the failed attempt's
    frames: its snapshot and a dense delta's payload (1x the model each, a 7B fp32 model's 28 GB
    twice) until the next failure. Once the retry published, the publisher holds what one that
    never failed holds: the version it remembers for the next delta."""
    import gc
    import tracemalloc

    rng = np.random.default_rng(0)
    first = {f"w{i}": rng.standard_normal(1 << 20, dtype=np.float32) for i in range(4)}  # 16 MB
    held = {}
    for fails in (False, True):
        failed = []

        def fail_once(name, step=[0], fails=fails, failed=failed):  # noqa: B006 - the step the publish is at
            if fails and name == "version-written" and not failed and step[0] == 3:
                failed.append(name)
                raise OSError(errno.EIO, "injected I/O error")

        stages.hook = fail_once
        tracemalloc.start()
        try:
            with ws.BackgroundPublisher(tmp_path / str(fails), delta=True, retry_backoff=0.01) as publisher:
                weights = first
                for step in range(1, 5):
                    fail_once.__defaults__[0][0] = step
                    weights = {key: value * np.float32(1.001) for key, value in weights.items()}
                    publisher.publish(weights, step=step).result(60)
                expected = weights["w0"].tolist()
                del weights
                gc.collect()
                held[fails] = tracemalloc.get_traced_memory()[0]
                assert publisher.failures == int(fails) and (publisher.last_error is not None) == fails
        finally:
            tracemalloc.stop()
            stages.hook = None
        assert ws.load(ws.latest(tmp_path / str(fails)))["w0"].tolist() == expected
    assert held[True] < held[False] + (4 << 20), held  # a snapshot or a payload is 16 MB


def test_a_failed_publish_is_counted_and_logged_never_raised_and_not_retried(tmp_path, caplog):
    ws.publish(tmp_path, weights(10), step=10)  # another trainer got there first
    publisher = ws.BackgroundPublisher(tmp_path, retry_backoff=0.01)
    with caplog.at_level(logging.ERROR, logger="weightstore"):
        failed = publisher.publish(weights(5), step=5)
        with pytest.raises(ws.PublishError, match=r"step 5 is not after step 10"):
            failed.result(60)  # the future has it, for a caller who asks
        assert publisher.publish(weights(11), step=11).result(60).step == 11
    assert publisher.failures == 1 and isinstance(publisher.last_error, ws.PublishError)  # not retried
    assert any("step 5" in record.getMessage() and "the last version published is" in record.getMessage()
               for record in caplog.records)
    assert publisher.close().step == 11 and ws.latest(tmp_path).step == 11


def test_a_local_write_failing_with_no_errno_is_not_retried(tmp_path, monkeypatch):
    """A local writer's OSError without an errno (the commit gives it errno 0) fails for good, as
    before: only an object store's answer without one (a bucket gone) may pass and is retried."""
    from weightstore.io.commit import RenameCommit
    from weightstore.sync import _background

    def failing(folder, *args, **kwargs):
        with RenameCommit(tmp_path / "out.npz").writing():
            raise OSError("the writer gave up")

    monkeypatch.setattr(_background, "publish_digested", failing)
    publisher = ws.BackgroundPublisher(tmp_path, retry_for=60, retry_backoff=0.01)
    with pytest.raises(ws.errors.WriteError, match=f"{tmp_path / 'out.npz'}: writing failed: the writer gave up"):
        publisher.publish(weights(1), step=1).result(60)
    assert publisher.failures == 1 and publisher.last_error.errno == 0


def test_a_bad_step_is_refused_at_the_call_and_costs_no_later_publish(tmp_path):
    """Checked on the thread, a bad step failed the future and then made the next, good
    publish raise it instead of publishing."""
    publisher = ws.BackgroundPublisher(tmp_path)
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            publisher.publish(weights(1), step=bad)
    assert publisher.publish(weights(4), step=np.int64(4)).result().step == 4  # optimizer.iterations.numpy()
    assert publisher.close().step == 4


@pytest.mark.parametrize("keep", [0, 1.5, True, "2"])
def test_keep_must_be_an_int_of_at_least_one(tmp_path, keep):
    with pytest.raises(ValueError, match="keep must be an int of at least 1"):
        ws.publish(tmp_path, weights(1), step=1, keep=keep)
    with pytest.raises(ValueError, match="keep must be an int of at least 1"):
        ws.BackgroundPublisher(tmp_path, keep=keep)
    assert ws.latest(tmp_path) is None


def test_close_refuses_further_publishes_and_wait_is_bounded(tmp_path, gate):
    publisher = ws.BackgroundPublisher(tmp_path)
    publisher.publish(weights(1), step=1)  # held
    while not gate.held:
        time.sleep(0.01)
    began = time.monotonic()
    assert publisher.wait(timeout=0.2) is None and time.monotonic() - began < 10
    gate.set()
    assert publisher.close().step == 1
    with pytest.raises(RuntimeError, match="closed") as caught:
        publisher.publish(weights(12), step=12)
    assert caught.value.path == str(tmp_path)


def test_an_error_is_raised_only_to_the_caller_who_asks_the_future(tmp_path):
    ws.publish(tmp_path, weights(10), step=10)
    with ws.BackgroundPublisher(tmp_path) as publisher:
        with pytest.raises(ws.PublishError):
            publisher.publish(weights(5), step=5).result()
        assert publisher.publish(weights(11), step=11).result().step == 11


def test_a_folder_that_becomes_unusable_ends_nothing_and_is_counted(tmp_path):
    folder = tmp_path / "run"
    with ws.BackgroundPublisher(folder) as publisher:
        publisher.publish(weights(1), step=1).result(60)
        shutil.rmtree(folder)
        folder.write_bytes(b"not a folder any more")
        publisher.publish(weights(2), step=2)
    assert publisher.last.step == 1 and publisher.failures == 1
    assert isinstance(publisher.last_error, ws.TargetError) and "is not a folder" in str(publisher.last_error)


def test_the_blocks_own_error_goes_through_unchanged(tmp_path):
    with pytest.raises(KeyError, match="from the block"), ws.BackgroundPublisher(tmp_path) as publisher:
        publisher.publish(weights(5), step=5)
        raise KeyError("from the block")
    assert publisher.last.step == 5


def test_bad_options_fail_at_once(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        ws.BackgroundPublisher(tmp_path, keep=0)
    with pytest.raises(ValueError, match="zip"):
        ws.BackgroundPublisher(tmp_path, format="zip")
    with pytest.raises(TypeError, match="JSON"):
        ws.BackgroundPublisher(tmp_path, metadata={"when": object()})
    with pytest.raises(ValueError, match="retry_for"):
        ws.BackgroundPublisher(tmp_path, retry_for=-1)


def test_a_failure_after_latest_moved_is_no_failed_publish(tmp_path, monkeypatch, caplog):
    """Tidying the folder after the swap (the intent, pruning) failed: the version is published,
    and the publisher says so rather than retrying into "step 7 is not after step 7"."""
    def failing_tidy(name):
        if name == "latest-written":
            raise OSError(5, "EIO while tidying")

    monkeypatch.setattr(stages, "hook", failing_tidy)
    with ws.BackgroundPublisher(tmp_path, retry_backoff=0.01) as publisher:
        assert publisher.publish(weights(7), step=7).result(60).step == 7
    assert publisher.last.step == 7 and publisher.failures == 0 and ws.latest(tmp_path).step == 7
    assert any("tidying the folder after it failed" in record.getMessage() for record in caplog.records)


def test_a_done_callback_may_wait_on_the_publisher(tmp_path):
    publisher = ws.BackgroundPublisher(tmp_path)
    waited = []
    future = publisher.publish(weights(1), step=1)
    future.add_done_callback(lambda done: waited.append(publisher.wait(timeout=30)))
    assert future.result(60).step == 1
    publisher.close(timeout=60)
    assert waited and waited[0].step == 1


def test_the_publishing_thread_is_no_daemon_whoever_asks(tmp_path, gate):
    threads = []

    def from_a_daemon():
        publisher = ws.BackgroundPublisher(tmp_path)
        publisher.publish(weights(1), step=1)
        threads.append(publisher._thread)

    caller = threading.Thread(target=from_a_daemon, daemon=True)
    caller.start()
    caller.join(30)
    assert threads and threads[0] is not None and not threads[0].daemon
    gate.set()


BUCKET = "weightstore-background"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_process_that_returns_mid_publish_publishes_its_last_snapshot(tmp_path, request, where):
    """A script that returns (or calls sys.exit) without close(): the publish in flight is written
    even though the interpreter's exit has begun, which makes thread pools refuse new work (on
    S3 the exit hung, asyncio's resolver refusing it)."""
    if where == "s3":
        request.getfixturevalue("s3")  # the child inherits the environment that points at it
    folder = str(tmp_path / "run") if where == "local" else f"s3://{BUCKET}/{tmp_path.name}"
    script = f"""
import sys, threading, time
import numpy as np
import weightstore as ws
from weightstore.sync import _stages as stages

def hold(name):  # the write goes on only once the interpreter's exit has begun
    if name == "locked":
        while not threading._SHUTTING_DOWN:  # private: set as threading's exit hooks start
            time.sleep(0.05)

stages.hook = hold
publisher = ws.BackgroundPublisher({folder!r}, keep=2)
publisher.publish({{"w": np.arange(4, dtype=np.float32)}}, step=7)
sys.exit(3)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "failed" not in done.stderr, done.stderr
    version = ws.latest(folder)
    assert version is not None and version.step == 7
    assert np.array_equal(ws.load(version)["w"], np.arange(4, dtype=np.float32))
    if where == "local":
        assert sorted(os.listdir(folder)) == [".publish.lock", "LATEST", "step-000000000007.npz"]


HELD_MID_WRITE_AT_EXIT = """
import os, sys, threading, time
import numpy as np
import weightstore as ws
from weightstore.sync import _stages as stages

def hold(name):  # mid-write (the version file written, LATEST not yet) until the test lets go
    if name == "version-written":
        print("held", flush=True)
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.02)

threading._register_atexit(lambda: print("exiting", flush=True))  # runs just before the exit's wait
stages.hook = hold
ws.BackgroundPublisher(sys.argv[1]).publish({"w": np.arange(4, dtype=np.float32)}, step=5)
"""


def test_ctrl_c_while_the_exit_waits_for_a_write_under_way_lets_that_write_land_whole(tmp_path):
    """Ctrl-C at exit gives a publish up, but a write already under way ends as it would: the
    process still waits for it (on CPython 3.11 an interrupted join had marked the thread
    stopped, and the interpreter then ended it mid-write: nothing was published)."""
    folder, release = tmp_path / "run", tmp_path / "release"
    script = subprocess.Popen([sys.executable, "-c", HELD_MID_WRITE_AT_EXIT, str(folder), str(release)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = {script.stdout.readline().strip(), script.stdout.readline().strip()}
        assert seen == {"held", "exiting"}, seen
        script.send_signal(signal.SIGINT)
        said = []
        while not any("still being written" in line for line in said):  # given up, the exit waits on
            said.append(script.stderr.readline())
            assert said[-1], "".join(said)
        release.touch()
        _, err = script.communicate(timeout=60)
    finally:
        script.kill()
    assert script.returncode == 0 and "Traceback" not in err, "".join(said) + err
    version = ws.latest(folder)
    assert version is not None and version.step == 5
    assert np.array_equal(ws.load(version)["w"], np.arange(4, dtype=np.float32))


GIVING_UP_SLOWLY_AT_EXIT = """
import concurrent.futures, threading, time
from weightstore.core._exiting import finish_before_exit

def give_up():  # as slow as a log handler on a busy disk: the second Ctrl-C lands here
    print("giving up", flush=True)
    time.sleep(60)

finish_before_exit(concurrent.futures.Future(), give_up)  # work no thread will finish
threading._register_atexit(lambda: print("exiting", flush=True))  # runs just before the exit's wait
"""


def test_a_second_ctrl_c_while_the_exit_gives_up_ends_the_wait_without_a_traceback():
    """A double Ctrl-C whose second lands while the first's give-up is still running (logging)
    ends weightstore's exit wait quietly: it escaped from the interpreter's exit hooks as an
    "Exception ignored" traceback, skipping the hooks after it."""
    script = subprocess.Popen([sys.executable, "-c", GIVING_UP_SLOWLY_AT_EXIT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert script.stdout.readline().strip() == "exiting"
        time.sleep(0.2)  # into the exit's wait
        script.send_signal(signal.SIGINT)
        assert script.stdout.readline().strip() == "giving up"
        script.send_signal(signal.SIGINT)
        _, err = script.communicate(timeout=30)
    finally:
        script.kill()
    assert script.returncode == 0 and "Traceback" not in err and "Exception ignored" not in err, err


def test_a_child_forked_while_a_publish_is_in_flight_exits(tmp_path):
    """The work waited for at exit is the parent's: a helper process forked while a background
    publish was in flight (a data loader's worker) hung at its exit, waiting for a future that
    no thread of its own would ever finish."""
    script = """
import os, sys, threading
from weightstore.sharded._shards import in_background
release = threading.Event()
future = in_background(lambda: release.wait(60))  # a background sharded publish in flight
pid = os.fork()
if pid == 0:
    sys.exit(0)
for _ in range(900):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    threading.Event().wait(0.1)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
release.set()
sys.exit(0 if done else 5)  # 5: the child hung at its exit
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_backoff_is_the_storages_so_newer_snapshots_do_not_hammer_a_failing_one(tmp_path, monkeypatch):
    """A trainer hands over a snapshot each step: each used to be tried at once, so the failing
    storage was asked once a step and logged once a step, whatever the backoff said."""
    from weightstore.sync import _background, _publish

    attempts, decided = [], threading.Event()  # the newest snapshot tried, or pausing untried

    def down(folder, weights, *, step, **options):
        attempts.append(step)
        if step != 1:
            decided.set()
        raise ws.StorageError("down", path=str(folder))

    monkeypatch.setattr(_background, "publish_digested", down)
    publisher = ws.BackgroundPublisher(tmp_path, retry_backoff=3600)
    pause = publisher._replaced_within

    def pausing(seconds):
        if publisher._writing is not None and publisher._writing.step == 5:
            decided.set()
        return pause(seconds)

    monkeypatch.setattr(publisher, "_replaced_within", pausing)
    first = publisher.publish(weights(1), step=1)
    while not attempts:
        threading.Event().wait(0.01)
    newer = [publisher.publish(weights(step), step=step) for step in range(2, 6)]
    with pytest.raises(ws.StorageError):
        first.result(60)  # it gave way to a newer snapshot
    assert all(future.cancelled() for future in newer[:-1])
    assert decided.wait(60)
    assert attempts == [1] and not newer[-1].done()  # the newest waits out the pause, untried
    monkeypatch.setattr(_background, "publish_digested", _publish.publish_digested)  # the storage answers again
    publisher._resume_at = 0.0  # the hour passes
    publisher.publish(weights(6), step=6)
    # replaced untried, it says so, not step 1's error; and no attempt of its failed to count
    with pytest.raises(ws.StorageError, match="step 5 was not published: the newer snapshot of step 6 replaced it"):
        newer[-1].result(60)
    assert publisher.close(60).step == 6 and ws.latest(tmp_path).step == 6
    assert publisher.failures == 1


FORKED = """
import multiprocessing, os, sys, threading
import numpy as np
import weightstore as ws
from weightstore.sync import _stages as stages

folder, how, when = sys.argv[1:4]
parent, written_in_child = os.getpid(), []
armed, held, release = threading.Event(), threading.Event(), threading.Event()


def weights(step, size=1000):
    return {"w": np.full(size, step, np.float32)}


def hook(name):
    if os.getpid() != parent:
        written_in_child.extend([name] if name == "version-written" else [])
    elif name == when and armed.is_set() and not held.is_set():  # step 2, held mid-write until the fork
        held.set()
        release.wait(60)


stages.hook = hook
publisher = ws.BackgroundPublisher(folder, retry_backoff=0.05, delta=True)
publisher.publish(weights(1), step=1).result(60)
armed.set()
writing = publisher.publish(weights(2, 1 << 24 if when == "big" else 1000), step=2)  # 64 MiB: a slow write
while when == "big" and not writing.running():  # being written, not pending: the fork comes mid-write
    threading.Event().wait(0.001)
if when == "idle":
    writing.result(60)
elif when != "big" and not held.wait(60):
    sys.exit(6)
pending = None if when == "idle" else publisher.publish(weights(3), step=3)  # the parent's to write


def child():
    # a fresh publisher: nothing of its own to wait for, the parent's snapshots not written here
    fresh = publisher.wait(60) is None and not publisher.busy
    while when == "big" and ws.latest(folder).step < 2:  # the parent's step 2 lands first, or 10 is no step forward
        threading.Event().wait(0.01)
    version = publisher.publish(weights(10), step=10).result(60)
    last = publisher.close(60)
    sys.exit(0 if fresh and version.step == last.step == 10 and written_in_child == ["version-written"] else 4)


if how == "multiprocessing":
    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    release.set()
    process.join(90)
    code = process.exitcode
    if code is None:
        process.kill()
        sys.exit(5)
else:
    pid = os.fork()
    if pid == 0:
        try:
            child()
        except Exception as exc:
            print(repr(exc), file=sys.stderr)
            raise
    release.set()
    for _ in range(900):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        sys.exit(5)  # 5: the child hung
    code = os.waitstatus_to_exitcode(status)
assert writing.result(60).step == 2
assert pending is None or pending.exception(60) is None or isinstance(pending.exception(), ws.PublishError)
publisher.close(60)
sys.exit(code)
"""


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
@pytest.mark.parametrize("when", ["version-temporary", "locked", "big", "idle"])
def test_a_child_forked_beside_a_publisher_publishes_as_a_fresh_one(tmp_path, how, when):
    """A child forked while its parent's publisher wrote (held mid-write at a stage, or writing
    a big snapshot) or idled: the child's publish, wait and close work as a new publisher's,
    writing only its own snapshot; the parent's go on. The child used to wait for a thread it
    does not have, or on the publish lock its copy of the parent's descriptor kept held."""
    folder = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", FORKED, str(folder), how, when], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    assert ws.latest(folder).step == 10
    for step in (2, 10):
        path = next(entry.path for entry in versions.list_versions(folder) if entry.step == step)
        assert np.all(ws.load(path)["w"] == step)


def test_an_open_of_latest_failing_with_eio_is_retried_as_an_outage(tmp_path, monkeypatch):
    """EIO opening LATEST (a network disk's hiccup) is the storage's, not the file's: the publish is
    retried and lands, where a link loop or no permission would be refused for good."""
    ws.publish(tmp_path, weights(1), step=1)
    real_open, failures = os.open, []

    def flaky_open(path, flags, *args, **kwargs):
        if str(path).endswith("LATEST") and len(failures) < 2:
            failures.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", flaky_open)
    with ws.BackgroundPublisher(tmp_path, retry_backoff=0.01) as publisher:
        assert publisher.publish(weights(2), step=2).result(60).step == 2
    assert len(failures) == 2 and publisher.failures >= 1  # counted, retried, landed
    failures.clear()
    with pytest.raises(ws.StorageError, match="cannot be opened") as caught:  # a weightstore error, naming it
        ws.latest(tmp_path)
    assert caught.value.path == str(tmp_path / "LATEST") and caught.value.transient
    monkeypatch.undo()
    assert ws.latest(tmp_path).step == 2
