"""Versioned folders on S3: the real s3fs client against moto's S3 server on 127.0.0.1."""

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
from processes import fork_together

import weightstore as ws
from weightstore import sync as versions
from weightstore.sync import _stages as stages

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from benchmarks.s3_server import CREDENTIALS, restore_environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "weightstore-tests"


@pytest.fixture(scope="module")
def s3():
    """Storage options for an S3 server of our own on a free loopback port."""
    saved = {key: os.environ.get(key) for key in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    import s3fs

    s3fs.S3FileSystem(**options).mkdir(BUCKET)
    try:
        yield options
    finally:
        server.stop()
        restore_environment(saved)


@pytest.fixture
def folder(s3):
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def weights_at(step: int) -> dict:
    return {f"layer_{i}/w": np.full((4,), step, np.float32) for i in range(3)}


def assert_whole(loaded: dict, step: int) -> None:
    assert sorted(loaded) == sorted(weights_at(step))
    assert all(np.all(value == step) for value in loaded.values()), step


def names(s3, folder: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    fs.invalidate_cache()
    return sorted(path.rsplit("/", 1)[-1] for path in fs.ls(folder[len("s3://"):]))


def test_publish_latest_follow_on_s3(s3, folder):
    assert ws.latest(folder, storage_options=s3) is None
    for step in range(1, 5):
        ws.publish(folder, weights_at(step), step=step, keep=2, metadata={"step": step}, storage_options=s3)
    version = ws.latest(folder, storage_options=s3)
    assert (version.step, version.path, version.metadata) == (4, f"{folder}/step-000000000004.npz", {"step": 4})
    assert_whole(ws.load(version), 4)
    assert names(s3, folder) == ["LATEST", "step-000000000003.npz", "step-000000000004.npz"]
    entries = versions.list_versions(folder, storage_options=s3)
    assert [(e.step, e.latest) for e in entries] == [(3, False), (4, True)] and entries[0].size > 0
    assert [v.step for v in ws.follow(folder, poll=0.01, timeout=0.05, storage_options=s3)] == [4]
    with pytest.raises(ws.PublishError, match="steps must increase"):
        ws.publish(folder, weights_at(4), step=4, storage_options=s3)


def test_pruned_version_on_s3_says_retry(s3, folder):
    ws.publish(folder, weights_at(1), step=1, keep=2, storage_options=s3)
    stale = ws.latest(folder, storage_options=s3)
    for step in (2, 3):
        ws.publish(folder, weights_at(step), step=step, keep=2, storage_options=s3)
    with pytest.raises(ws.VersionGoneError, match="retry"):
        ws.load(stale)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_a_version_pruned_while_it_is_read_on_s3_says_retry(s3, folder, suffix):
    """An object store cannot pin an open version: a reader that lags more than ``keep``
    publishes loses it mid-read, and must get the error that says to read LATEST again."""
    big = {"w": np.arange(1 << 20, dtype=np.float32), "v": np.arange(1 << 20, dtype=np.float32)}  # past the index
    ws.publish(folder, big, step=1, keep=2, format=suffix.lstrip("."), storage_options=s3)
    with ws.open(ws.latest(folder, storage_options=s3)) as store:
        for step in (2, 3):
            ws.publish(folder, weights_at(step), step=step, keep=2, format=suffix.lstrip("."), storage_options=s3)
        with pytest.raises(ws.VersionGoneError, match="version 1 is gone .*read LATEST again") as caught:
            store["w"]
    assert caught.value.path == f"{folder}/step-000000000001{suffix}"


@pytest.mark.parametrize("content", [b"", b"not json", b'{"format": "weightstore-latest"}'])
def test_damaged_latest_on_s3(s3, folder, content):
    import s3fs

    ws.publish(folder, weights_at(1), step=1, storage_options=s3)
    s3fs.S3FileSystem(**s3).pipe_file(f"{folder}/LATEST", content)
    with pytest.raises(ws.FormatError, match="LATEST is"):
        ws.latest(folder, storage_options=s3)


def test_a_huge_latest_on_s3_is_refused_and_read_only_up_to_the_pointer_limit(s3, folder):
    import s3fs

    from weightstore.io.folders import folder_for

    ws.publish(folder, weights_at(1), step=1, storage_options=s3)
    s3fs.S3FileSystem(**s3).pipe_file(f"{folder}/LATEST", b" " * (8 << 20))
    with pytest.raises(ws.FormatError, match="LATEST is"):
        ws.latest(folder, storage_options=s3)
    remote = folder_for(folder, s3)
    assert remote.read_small("LATEST", 1000) == b" " * 1000
    assert remote.read_tagged("LATEST", 1000)[0] == b" " * 1000


def test_latest_naming_a_missing_object(s3, folder):
    import s3fs

    ws.publish(folder, weights_at(1), step=1, storage_options=s3)
    s3fs.S3FileSystem(**s3).rm_file(f"{folder}/step-000000000001.npz")
    with pytest.raises(ws.StoreNotFoundError, match="LATEST names .* which does not exist"):
        next(ws.follow(folder, timeout=0, storage_options=s3))


def test_missing_latest_on_s3_keeps_versions(s3, folder):
    import s3fs

    for step in (1, 2, 3):
        ws.publish(folder, weights_at(step), step=step, storage_options=s3)
    s3fs.S3FileSystem(**s3).rm_file(f"{folder}/LATEST")
    with pytest.warns(UserWarning, match="LATEST is missing"), pytest.raises(ws.PublishError, match="not after step 3"):
        ws.publish(folder, weights_at(1), step=1, storage_options=s3)
    with pytest.warns(UserWarning, match="LATEST is missing"):
        ws.publish(folder, weights_at(4), step=4, storage_options=s3)
    assert names(s3, folder) == ["LATEST"] + [f"step-00000000000{step}.npz" for step in (1, 2, 3, 4)]


KILLED_PUBLISHER = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import weightstore as ws
    from weightstore.sync import _stages as stages
    folder, stage, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    def weights(step):
        return {f"layer_{i}/w": np.full((4,), step, np.float32) for i in range(3)}
    for step in (1, 2, 3):
        ws.publish(folder, weights(step), step=step, keep=2, storage_options=options)
    def hook(name):
        if name == stage:
            os.kill(os.getpid(), signal.SIGKILL)
    stages.hook = hook  # the no-op each stage of a publish calls
    ws.publish(folder, weights(4), step=4, keep=2, storage_options=options)
    sys.exit(3)
""")


KILLED_STAGES = ["version-temporary", "version-written", "latest-written", "pruning"]


@pytest.fixture(scope="module")
def killed_at(s3):
    """The folder of a publisher SIGKILLed at each stage, by stage: the publishers run at once,
    forked from one interpreter that imported weightstore and s3fs (``processes.fork_together``)."""
    folders = {stage: f"s3://{BUCKET}/{uuid.uuid4().hex}" for stage in KILLED_STAGES}
    publishers = fork_together("import numpy, s3fs, weightstore", KILLED_PUBLISHER,
                               [[folder, stage, json.dumps(s3)] for stage, folder in folders.items()],
                               [{**os.environ, "PYTHONPATH": str(ROOT)}] * len(folders), timeout=120)
    for publisher in publishers:
        assert publisher.returncode == -signal.SIGKILL, publisher.stderr
    return folders


@pytest.mark.parametrize("stage", KILLED_STAGES)
def test_publisher_killed_on_s3(s3, killed_at, stage):
    folder = killed_at[stage]
    expected = 4 if stage in ("latest-written", "pruning") else 3
    version = ws.latest(folder, storage_options=s3)
    assert version.step == expected
    assert_whole(ws.load(version), expected)
    ws.publish(folder, weights_at(5), step=5, keep=2, storage_options=s3)
    assert names(s3, folder) == ["LATEST", f"step-00000000000{expected}.npz", "step-000000000005.npz"]


def test_reader_racing_publishes_on_s3(s3, folder):
    ws.publish(folder, weights_at(0), step=0, keep=2, storage_options=s3)
    failures = []

    def publisher():
        try:
            for step in range(1, 31):
                ws.publish(folder, weights_at(step), step=step, keep=2, storage_options=s3)
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    thread = threading.Thread(target=publisher)
    thread.start()
    seen = []
    for version in ws.follow(folder, poll=0.01, timeout=2.0, storage_options=s3):
        assert_whole(ws.load(version), version.step)
        seen.append(version.step)
        if version.step == 30:
            break
    thread.join()
    assert not failures
    assert seen == sorted(set(seen)) and seen[-1] == 30


def test_follow_waits_out_an_outage(s3, caplog):
    """A service that goes away for a while is waited out, not fatal (it used to kill ``follow``)."""
    import s3fs

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
               "config_kwargs": {"retries": {"max_attempts": 1}}}
    s3fs.S3FileSystem.clear_instance_cache()
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    ws.publish(url, weights_at(1), step=1, storage_options=options)
    seen, errors = [], []

    def follow():
        try:
            for version in ws.follow(url, poll=0.05, timeout=30, storage_options=options):
                seen.append(version.step)
                if version.step == 2:
                    return
        except Exception as exc:  # noqa: BLE001 - whatever comes out is the failure under test
            errors.append(exc)

    thread = threading.Thread(target=follow)
    thread.start()
    server.stop()  # the outage: every request is refused for a while
    try:
        thread.join(1.0)
        assert thread.is_alive() and errors == []
    finally:
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
    try:
        ws.publish(url, weights_at(2), step=2, storage_options=options)
        thread.join(30)
        assert errors == [] and seen[-1] == 2
        waited = [record.getMessage() for record in caplog.records if "waiting for" in record.getMessage()]
        assert len(waited) == 1 and "storage failed" in waited[0] and waited[0].endswith("; retrying")  # said once
        assert "answers again" in caplog.text
    finally:
        server.stop()


def test_ws_follow_says_once_that_it_waits_for_a_closed_port_and_once_that_it_answers(monkeypatch):
    """A mistyped port refuses every connection, as a stopped server does: ``ws follow`` waits
    (the two look the same), and says so on stderr when the outage starts and when it ends,
    not once a retry; with --json, stdout holds only JSON lines."""
    import queue

    import s3fs

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed: nothing listens there until the server starts below
    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"weightstore-closed-port-{uuid.uuid4().hex[:8]}"  # moto's buckets are the process's, whatever port
    folder = f"s3://{bucket}/run"
    for name, value in CREDENTIALS.items():  # this process's own client too, however the tests are ordered
        monkeypatch.setenv(name, value)
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": endpoint, "AWS_MAX_ATTEMPTS": "1",
           "PYTHONPATH": str(ROOT)}
    command = subprocess.Popen([sys.executable, "-m", "weightstore", "follow", folder, "--json", "--poll", "0.05",
                                "--max-poll", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
    watchdog = threading.Timer(120, command.kill)  # the process never outlives the test
    watchdog.start()
    said: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [said.put(line) for line in command.stderr], daemon=True)
    reader.start()
    server = None
    try:
        assert "waiting for" in said.get(timeout=60)
        retried = threading.Event()
        retried.wait(1.0)  # some twenty looks refused, none of them said
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        options = {"client_kwargs": {"endpoint_url": endpoint}}
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem(**options).mkdir(bucket)
        ws.publish(folder, weights_at(1), step=1, storage_options=options)
        first = command.stdout.readline()
    finally:
        command.kill()
        watchdog.cancel()
        command.wait(60)
        out = command.stdout.read()  # stderr is the reader's alone: it reads on to the end, then ends
        reader.join(10)
        if server is not None:
            server.stop()
    lines = []
    while not said.empty():
        lines.append(said.get())
    assert json.loads(first)["step"] == 1 and all(json.loads(line) for line in out.splitlines())
    # the outage's start was the line taken above; a first look that found nothing published may say so
    assert [line for line in lines if "waiting for" in line and "no version yet" not in line] == [], lines
    assert [line.strip() for line in lines if "answers again" in line] == [f"weightstore: {folder} answers again"]
    assert "Traceback" not in "".join(lines)


def test_follow_raises_a_storage_error_when_the_outage_outlasts_its_timeout(s3):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
               "config_kwargs": {"retries": {"max_attempts": 1}}}
    with pytest.raises(ws.StorageError, match=rf"s3://{BUCKET}/down: storage failed"):
        next(ws.follow(f"s3://{BUCKET}/down", poll=0.05, timeout=0.5, storage_options=options))


ABANDONED_FOLLOW = textwrap.dedent("""
    import json, sys
    import numpy as np
    import weightstore as ws
    folder, options = sys.argv[1], json.loads(sys.argv[2])
    ws.publish(folder, {"w": np.ones(1 << 18, np.float32)}, step=1, storage_options=options)  # 1 MB: read in ranges
    following = ws.follow(folder, timeout=30, storage_options=options)
    version = next(following)  # pinned: its file stays open
    store = ws.open(version)
    assert float(store["w"][0]) == 1.0
    print("followed", version.step)  # then exit with the generator (and the store) left open
""")


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_abandoned_follow_generator_exits_quietly(s3, folder, tmp_path, where):
    target, options = (folder, s3) if where == "s3" else (str(tmp_path / "run"), {})
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", ABANDONED_FOLLOW, target, json.dumps(options)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["followed", "1"], result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr


PUBLISHER_PROCESS = textwrap.dedent("""
    import json, sys
    import numpy as np
    import weightstore as ws
    folder, options = sys.argv[1], json.loads(sys.argv[2])
    for line in sys.stdin:  # a step to publish
        step = int(line)
        ws.publish(folder, {f"layer_{i}/w": np.full((4,), step, np.float32) for i in range(3)}, step=step,
                   storage_options=options)
        print(step, flush=True)
""")


@contextlib.contextmanager
def publisher_elsewhere(folder: str, options: dict):
    """``publish(step)``, published by another process (another s3fs, with listings of its own):
    one for the test, not one interpreter per step."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER_PROCESS, folder, json.dumps(options)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def publish(step: int) -> None:
        proc.stdin.write(f"{step}\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == str(step), "the other process did not publish (its stderr above)"

    try:
        yield publish
    finally:
        proc.stdin.close()
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_follow_sees_what_another_process_published_after_this_one_listed(s3, folder):
    """s3fs caches listings per process: what ``ws versions`` listed must not hide later publishes."""
    assert versions.list_versions(folder.rsplit("/", 1)[0], storage_options=s3) is not None  # the bucket, listed
    with pytest.raises(ws.StoreNotFoundError):
        versions.list_versions(folder, storage_options=s3)  # the folder, listed before it exists
    with publisher_elsewhere(folder, s3) as publish_elsewhere:
        publish_elsewhere(1)  # the first LATEST, from another process
        assert ws.latest(folder, storage_options=s3).step == 1
        assert [entry.step for entry in versions.list_versions(folder, storage_options=s3)] == [1]
        publish_elsewhere(2)  # a version this process's listing never saw
        following = ws.follow(folder, timeout=5, poll=0.05, storage_options=s3)
        try:
            version = next(following)
            assert version.step == 2
            assert_whole(ws.load(version), 2)
            publish_elsewhere(3)
            assert_whole(ws.load(next(following)), 3)
        finally:
            following.close()
    assert_whole(ws.load(ws.latest(folder, storage_options=s3)), 3)



def test_a_trainer_whose_folder_another_process_took_over_on_s3_is_refused(s3, folder):
    """Two live publishers whose steps both go up, on S3 as locally: the process that published
    last keeps the folder, and the one it took over from is refused, naming both writers."""
    ws.publish(folder, weights_at(1), step=1, storage_options=s3)
    with publisher_elsewhere(folder, s3) as publish_elsewhere:
        publish_elsewhere(2)  # another process's first publish here: it takes the folder over
        with pytest.raises(ws.PublishError, match=f"another writer .*published step 2.*pid {os.getpid()}") as caught:
            ws.publish(folder, weights_at(3), step=3, storage_options=s3)
        assert caught.value.path == folder
        publish_elsewhere(4)
    assert_whole(ws.load(ws.latest(folder, storage_options=s3)), 4)

STOPPED_PUBLISHER = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import weightstore as ws
    from weightstore.sync import _stages as stages
    folder, options = sys.argv[1], json.loads(sys.argv[2])
    def weights(step):  # node A's, told apart from node B's by their sign
        return {f"layer_{i}/w": np.full((4,), -step, np.float32) for i in range(3)}
    for step in (1, 2, 3):
        ws.publish(folder, weights(step), step=step, storage_options=options)
    # stopped (SIGSTOP: a node paused, a VM migrated) with step 4 written, not yet uploaded
    stages.hook = lambda name: name == "version-temporary" and os.kill(os.getpid(), signal.SIGSTOP)
    try:
        ws.publish(folder, weights(4), step=4, storage_options=options)
    except ws.PublishError as exc:
        sys.exit(f"refused: {exc}")
""")


@pytest.mark.parametrize("published_after", [4, 5])
def test_a_publisher_stopped_mid_publish_never_replaces_the_version_a_restarted_trainer_published(
        s3, folder, tmp_path, published_after):
    """Node A is stopped with step 4 written but not uploaded; the trainer, restarted on node B
    from its step-3 checkpoint, publishes steps 4 (and 5). When A resumes, its upload must not
    replace B's step 4 (followers would serve A's weights as B's), nor its refused publish remove
    it (a published version lost)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    node_a = subprocess.Popen([sys.executable, "-c", STOPPED_PUBLISHER, folder, json.dumps(s3)], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        _, status = os.waitpid(node_a.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), node_a.stderr.read()
        with publisher_elsewhere(folder, s3) as publish_on_b:
            for step in range(4, published_after + 1):
                publish_on_b(step)
        os.kill(node_a.pid, signal.SIGCONT)
        _, error = node_a.communicate(timeout=60)
    finally:
        if node_a.poll() is None:
            node_a.kill()
            node_a.wait()
    assert node_a.returncode == 1 and "another writer wrote its own step-000000000004.npz" in error, error
    assert ws.latest(folder, storage_options=s3).step == published_after
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    for step in range(4, published_after + 1):  # B's weights, not A's
        fs.get(f"{folder}/step-{step:012d}.npz", str(tmp_path / f"{step}.npz"))
        assert_whole(ws.load(tmp_path / f"{step}.npz"), step)


PAUSED_PUBLISHER = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import weightstore as ws
    from weightstore.sync import _stages as stages
    folder, options, sign, pause = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    by = "A" if sign > 0 else "B"
    if by == "A":
        for step in (1, 2, 3):
            ws.publish(folder, {"w": np.full(4, step, np.float32)}, step=step, storage_options=options)
    stages.hook = lambda name: name == pause and os.kill(os.getpid(), signal.SIGSTOP)
    try:
        ws.publish(folder, {"w": np.full(4, 4 * sign, np.float32)}, step=4, metadata={"by": by},
                   storage_options=options)
        print("published", flush=True)
    except ws.PublishError as exc:
        print("refused:", exc, flush=True)
""")


def paused(folder: str, options: dict, sign: int, pause: str) -> subprocess.Popen:
    """A publisher of step 4 (A: sign 1, after steps 1-3; B: sign -1), stopped once at stage ``pause``."""
    process = subprocess.Popen([sys.executable, "-c", PAUSED_PUBLISHER, folder, json.dumps(options), str(sign), pause],
                               env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    _, status = os.waitpid(process.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), process.communicate()
    return process


def resumed(process: subprocess.Popen) -> str:
    os.kill(process.pid, signal.SIGCONT)
    return process.communicate(timeout=60)[0]


@pytest.mark.parametrize("a_paused_at", ["version-written", "latest-temporary"])
@pytest.mark.slow  # two publishing processes paused in turn
def test_latest_never_serves_one_publishers_record_on_anothers_file_of_its_step(s3, folder, a_paused_at, caplog):
    """A is paused between its upload of step 4 and its swap of LATEST; its restart B takes A's file
    for a killed publish's leftover, removes it, uploads its own step 4 and is paused before its
    swap; A goes on first. Before its swap A sees the object is not its own and is refused, so B's
    step 4 is published. Where A was paused past that look, its swap names B's file under A's
    record: readers refuse that version (it is never served with the other's metadata), a
    follower passes over it, and the next publish is served."""
    a = paused(folder, s3, 1, a_paused_at)
    b = None
    try:
        b = paused(folder, s3, -1, "version-written")
        said_a, said_b = resumed(a), resumed(b)
    finally:
        for process in (a, b):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    latest = ws.latest(folder, storage_options=s3)
    assert latest.step == 4
    if a_paused_at == "version-written":
        assert said_a.startswith("refused:") and "another writer put its own step-000000000004.npz" in said_a, said_a
        assert said_b.startswith("published"), said_b
        assert latest.metadata == {"by": "B"}
        np.testing.assert_array_equal(ws.load(latest)["w"], np.full(4, -4, np.float32))
        return
    assert said_a.startswith("published") and said_b.startswith("refused:"), (said_a, said_b)
    with pytest.raises(ws.FormatError, match="record of a publish made at .* written by another") as caught:
        ws.load(latest)
    assert caught.value.path == latest.path
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        assert next(ws.follow(folder, storage_options=s3, poll=0.05, timeout=0.3), None) is None
    assert "passing over version 4" in caplog.text
    with publisher_elsewhere(folder, s3) as publish:
        publish(5)
    assert_whole(ws.load(ws.latest(folder, storage_options=s3)), 5)


STOPPED_IN_ITS_FIRST_PUBLISH = textwrap.dedent("""
    import json, os, signal, sys
    import numpy as np
    import weightstore as ws
    from weightstore.sync import _stages as stages
    folder, options = sys.argv[1], json.loads(sys.argv[2])
    # its first publish here, stopped once past its checks (SIGSTOP: a paused node)
    stages.hook = lambda name: name == "cleaned" and os.kill(os.getpid(), signal.SIGSTOP)
    for step in (10, 11):
        try:
            ws.publish(folder, {f"layer_{i}/w": np.full((4,), -step, np.float32) for i in range(3)}, step=step,
                       storage_options=options)
            print(f"published {step}", flush=True)
        except ws.PublishError as exc:
            print(f"refused {step}: {exc}", flush=True)
        stages.hook = None
""")


def test_a_trainer_stopped_in_its_first_publish_never_takes_the_folder_from_its_restart(s3, folder):
    """Node A's trainer is stopped in its first publish; its restart on node B takes the folder
    over. Once A goes on, its publishes are refused, that one and the next: A never published
    here, but a writer new since it began to took over (else A's next publish took the folder
    back, and B's were refused from then on)."""
    ws.publish(folder, weights_at(1), step=1, storage_options=s3)  # the run that died
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    node_a = subprocess.Popen([sys.executable, "-c", STOPPED_IN_ITS_FIRST_PUBLISH, folder, json.dumps(s3)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        _, status = os.waitpid(node_a.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        with publisher_elsewhere(folder, s3) as publish_on_b:
            publish_on_b(2)  # B's first publish: it takes the folder over
            os.kill(node_a.pid, signal.SIGCONT)
            said, _ = node_a.communicate(timeout=60)
            publish_on_b(3)  # B goes on publishing
    finally:
        if node_a.poll() is None:
            node_a.kill()
            node_a.wait()
    first, second = said.splitlines()
    assert first.startswith("refused 10:") and "LATEST changed" in first, said
    assert second.startswith("refused 11:") and "another writer" in second and "began its first publish" in second
    assert_whole(ws.load(ws.latest(folder, storage_options=s3)), 3)


def test_a_sharded_version_reads_its_members_with_the_folders_storage_options(s3, folder):
    """The endpoint is given in storage_options only (not the environment): the members of a
    sharded version are read through the same options as its index."""
    weights = np.arange(64, dtype=np.float32).reshape(8, 8)
    for rank in range(2):
        ws.publish_shard(folder, {"w": ws.Piece(weights[4 * rank:4 * rank + 4], (4 * rank, 0), (8, 8))}, step=1,
                         rank=rank, world=2, attempt=0, storage_options=s3)
    ws.commit_shards(folder, step=1, world=2, attempt=0, timeout=10, storage_options=s3)
    version = ws.latest(folder, storage_options=s3)
    assert version.path.endswith(".wsindex")
    np.testing.assert_array_equal(ws.load(version)["w"], weights)


def test_the_loser_of_a_publish_race_on_s3_can_publish_its_step_again(s3, folder, monkeypatch):
    """Of two publishers that read the same LATEST, the one whose swap fails removes its own
    version file: left above LATEST, no intent naming it, it read as a restored LATEST and
    refused the loser's retry of its own step."""
    ws.publish(folder, weights_at(9), step=9, storage_options=s3)
    both_read, first_done = threading.Barrier(2, timeout=30), threading.Event()

    def stage(name):
        if name == "cleaned":
            both_read.wait()  # both have read LATEST, step 9
        if name == "version-written" and threading.current_thread().name == "second":
            first_done.wait(30)  # the first swaps LATEST while the second's version is written

    monkeypatch.setattr(stages, "hook", stage)
    outcomes = {}

    def publish(step):
        try:
            outcomes[step] = ws.publish(folder, weights_at(step), step=step, storage_options=s3).step
        except ws.PublishError as exc:
            outcomes[step] = exc
        finally:
            if threading.current_thread().name == "first":
                first_done.set()

    threads = [threading.Thread(target=publish, args=(10,), name="first"),
               threading.Thread(target=publish, args=(11,), name="second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    monkeypatch.setattr(stages, "hook", lambda name: None)
    assert outcomes[10] == 10
    assert isinstance(outcomes[11], ws.PublishError) and "publish it again" in str(outcomes[11])
    assert "step-000000000011.npz" not in names(s3, folder)
    assert ws.publish(folder, weights_at(11), step=11, storage_options=s3).step == 11
    assert_whole(ws.load(ws.latest(folder, storage_options=s3)), 11)


def test_ws_follow_on_s3_says_once_what_it_waits_for(s3, folder):
    """``--wait`` on a folder with nothing published, and ``--after`` past the newest version,
    wait: said once on stderr, as for a local folder, rather than in silence."""
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": s3["client_kwargs"]["endpoint_url"], "PYTHONPATH": str(ROOT)}

    def ws_follow(*args):
        return subprocess.run([sys.executable, "-m", "weightstore", "follow", *args, "--timeout", "0.2", "--poll",
                               "0.05"], capture_output=True, text=True, timeout=120, env=env)

    empty = ws_follow(folder, "--wait")
    assert empty.returncode == 0 and empty.stdout == "", empty.stderr
    assert empty.stderr == f"weightstore: following {folder}: no version yet; waiting for its first version\n"
    ws.publish(folder, weights_at(3), step=3, storage_options=s3)
    after = ws_follow(folder, "--after", "1000")
    assert after.returncode == 0 and after.stdout == "", after.stderr
    assert after.stderr == (f"weightstore: following {folder}: its latest version is step 3; waiting for a version "
                            "above step 1000\n")
