"""A Follower serving from S3: moto's server on 127.0.0.1, the real s3fs client, a real Keras model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import weightstore as ws  # noqa: E402
from weightstore.adapters.serving.follower import Follower  # noqa: E402

BUCKET = "weightstore-follower"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def folder(s3) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, name="hidden"), keras.layers.Dense(1, name="out")])


def weights_at(model: keras.Model, step: int) -> dict[str, np.ndarray]:
    from weightstore.adapters import tf2

    return {key: np.full(value.shape, step, value.dtype) for key, value in tf2.export(model).items()}


def reads_tensor_data(environ, step: int) -> bool:
    """Whether a request reads version ``step``'s tensors: from its first bytes (its index, which
    opening the version reads at once, is at its end)."""
    return (environ["REQUEST_METHOD"] == "GET" and f"step-{step:012d}" in environ.get("PATH_INFO", "")
            and environ.get("HTTP_RANGE", "").startswith("bytes=0-"))


def held_until(gate: threading.Event, fetching: threading.Event, step: int = 2, *, then_fail: bool = False):
    """A server intercept holding every read of version ``step``'s tensors until ``gate`` opens,
    then answering it (or, ``then_fail``, failing it with a 500)."""
    def hold(environ):
        if reads_tensor_data(environ, step):
            fetching.set()
            gate.wait(30)
            if then_fail:
                return 500, b"<Error><Code>InternalError</Code><Message>down</Message></Error>"
        return None
    return hold


def test_serving_is_not_held_while_a_version_downloads(s3, folder, model):
    ws.publish(folder, weights_at(model, 1), step=1)
    fetching, gate = threading.Event(), threading.Event()
    hold_the_tensor_data = held_until(gate, fetching)

    with Follower(model, folder, poll=0.01) as follower:
        assert follower.wait(1, timeout=30).step == 1
        s3.intercept = hold_the_tensor_data
        ws.publish(folder, weights_at(model, 2), step=2)
        try:
            assert fetching.wait(30), "the follower never fetched step 2"
            entered = threading.Event()

            def serve() -> None:
                with follower.reading():
                    entered.set()

            start = time.monotonic()
            reader = threading.Thread(target=serve)
            reader.start()
            reader.join(5)
            assert entered.is_set(), "reading() waited on the download"
            assert time.monotonic() - start < 5
            assert follower.version.step == 1  # still serving the old version, whole
            assert np.all(model.get_layer("hidden").kernel.numpy() == 1)
        finally:
            gate.set()
        assert follower.wait(2, timeout=30).step == 2
        assert np.all(model.get_layer("hidden").kernel.numpy() == 2) and follower.error is None


def pointer_requests(s3, folder: str) -> list:
    key = folder[len("s3://"):].split("/", 1)[1] + "/LATEST"
    return [r for r in s3.requests if r.path.endswith(key)]


def test_stop_does_not_wait_for_a_stalled_download_and_nothing_is_assigned_after_it(s3, folder, model):
    """A download an outage stalls can take minutes to fail (the client's read timeout, its
    retries): stop() returns at once, and the loop it left ends without touching the model or
    recording the failure that ends it."""
    ws.publish(folder, weights_at(model, 1), step=1)
    fetching, gate = threading.Event(), threading.Event()
    hold_the_tensor_data = held_until(gate, fetching, then_fail=True)

    follower = Follower(model, folder, poll=0.01).start()
    try:
        assert follower.wait(1, timeout=30).step == 1
        s3.intercept = hold_the_tensor_data
        ws.publish(folder, weights_at(model, 2), step=2)
        assert fetching.wait(30), "the follower never fetched step 2"
        start = time.monotonic()
        follower.stop()
        assert time.monotonic() - start < 5
    finally:
        gate.set()
    loops = [t for t in threading.enumerate() if t.name == f"weightstore-follower {folder}"]
    for loop in loops:
        loop.join(30)
    assert not any(loop.is_alive() for loop in loops)
    assert follower.version.step == 1 and np.all(model.get_layer("hidden").kernel.numpy() == 1)
    assert follower.error is None  # the download failed after the stop: no news of the follower's


def test_a_version_whose_download_failed_is_fetched_again(s3, folder, model):
    """An outage while a version's tensors download is the storage's, not the version's: the
    follower retries that version until it is in, with no publish needed to unstick it."""
    ws.publish(folder, weights_at(model, 1), step=1)
    failures = []

    def fail_step_2_reads(environ):
        """Fail the first reads of step 2's tensors, after its index (at its end) was read and pinned."""
        if reads_tensor_data(environ, 2) and len(failures) < 3:
            failures.append(environ.get("HTTP_RANGE"))
            return 500, b"<Error><Code>InternalError</Code><Message>down</Message></Error>"
        return None

    with Follower(model, folder, poll=0.01) as follower:
        assert follower.wait(1, timeout=30).step == 1
        s3.intercept = fail_step_2_reads
        ws.publish(folder, weights_at(model, 2), step=2)
        deadline = time.monotonic() + 30
        while (follower.version.step != 2 or follower.error is not None) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert failures, "the outage never hit the download"
        assert follower.version.step == 2 and follower.error is None
        assert np.all(model.get_layer("hidden").kernel.numpy() == 2)


def test_a_follower_started_during_an_outage_waits_it_out(s3, folder, model, caplog):
    """A serving process started while the storage is down: wait() gets the version once the storage
    answers (it raised the outage's StorageError at once, as it does a damaged folder's error).
    The outage is logged when it starts and when it ends, not once a look."""
    ws.publish(folder, weights_at(model, 3), step=3)
    waiting, refused = threading.Event(), []

    def down_until_waited_on(environ):
        """Refuse every request until wait() has been called and three more were refused."""
        if len(refused) < 3:
            if waiting.is_set():
                refused.append(environ["PATH_INFO"])
            return 503, b"<Error><Code>SlowDown</Code><Message>down</Message></Error>"
        return None

    s3.intercept = down_until_waited_on
    with Follower(model, folder, poll=0.05) as follower:
        deadline = time.monotonic() + 60
        while not isinstance(follower.error, ws.StorageError) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert isinstance(follower.error, ws.StorageError)
        waiting.set()
        assert follower.wait(timeout=60).step == 3 and follower.error is None
    assert len(refused) == 3 and np.all(model.get_layer("hidden").kernel.numpy() == 3)
    said = [record.getMessage() for record in caplog.records if folder in record.getMessage()]
    started = [line for line in said if "waiting for" in line]
    assert len(started) == 1 and started[0].startswith(f"weightstore follower: waiting for {folder}: storage "
                                                       "failed (") and started[0].endswith("; retrying"), said
    assert [line for line in said if "answers again" in line] == [f"weightstore follower: {folder} answers again"]


def test_a_follower_says_when_the_outage_changes_cause_and_says_it_afresh_once_restarted(s3, folder, model,
                                                                                         caplog):
    """One line per outage, but another when its cause changes kind (503, which passes, then 403,
    which waits for someone): the first line alone would hide why it goes on. A follower stopped
    during an outage and started again says its new loop's outage afresh."""
    ws.publish(folder, weights_at(model, 3), step=3)
    answers: list[int] = []

    def failing(environ):
        if answers:
            status = answers.pop(0)
            code = "SlowDown" if status == 503 else "AccessDenied"
            body = f"<Error><Code>{code}</Code><Message>no</Message></Error>".encode()
            return status, b"" if environ["REQUEST_METHOD"] == "HEAD" else body  # a HEAD's answer has no body
        return None

    s3.intercept = failing

    def ridden_out(follower):
        deadline = time.monotonic() + 60
        while (answers or follower.error is not None) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not answers and follower.error is None

    follower = Follower(model, folder, poll=0.02, max_poll=0.02)
    answers.extend([503] * 12 + [403] * 6)
    with follower:
        ridden_out(follower)
    answers.extend([503] * 10_000)
    with follower:  # stopped during an outage
        deadline = time.monotonic() + 60
        while not isinstance(follower.error, ws.StorageError) and time.monotonic() < deadline:
            time.sleep(0.02)
    answers[:] = [503] * 12
    with follower:
        ridden_out(follower)
    said = [record.getMessage() for record in caplog.records if folder in record.getMessage()]
    started = [line for line in said if "waiting for" in line]
    assert len(started) == 4, said
    assert ["Forbidden" in line for line in started] == [False, True, False, False], said


def test_an_idle_follower_asks_for_the_pointer_without_moving_it(s3, folder):
    """Each look is a HEAD (ETag unchanged: no body); LATEST's body moves only when it changed."""
    from weightstore import sync as versions
    from weightstore.io.folders import folder_for

    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    s3.reset()
    following = ws.follow(folder, poll=0.01, max_poll=0.01, timeout=0.5)
    assert next(following).step == 1
    assert list(following) == []  # half a second of looks, nothing new
    looks = [r.method for r in pointer_requests(s3, folder)]
    assert looks.count("GET") == 1 and len(looks) > 5
    after_the_read = pointer_requests(s3, folder)[looks.index("GET") + 1:]
    assert after_the_read and all(r.method == "HEAD" and r.sent == 0 for r in after_the_read)
    watch = versions.PointerWatch(folder_for(folder), poll=0.01, max_poll=0.08)
    assert watch.newer(None).step == 1
    intervals = []
    for _ in range(5):
        assert watch.newer(1) is None
        intervals.append(watch.interval)
    assert intervals == [0.02, 0.04, 0.08, 0.08, 0.08]  # backing off while idle, up to max_poll
    ws.publish(folder, {"w": np.ones(4, np.float32)}, step=2)
    assert watch.newer(1).step == 2 and watch.interval == 0.01  # a new version resets it


def test_opening_a_version_costs_one_request(s3, folder):
    """A version opens as a URL does (docs/object-storage.md): one ranged GET fetches its index,
    no HEAD first. Every reload of every follower pays it."""
    ws.publish(folder, {"w": np.zeros((256, 256), np.float32)}, step=1)
    version = ws.latest(folder)
    s3.reset()
    with ws.open(version) as store:
        assert store.keys() == ["w"]
    assert [r.method for r in s3.requests] == ["GET"]


@pytest.fixture
def notified(s3, monkeypatch):
    """A bucket whose writes S3 announces to an SQS queue of the same loopback server: (folder, queue URL)."""
    import botocore.session

    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", s3.endpoint)
    session = botocore.session.get_session()
    sqs, s3_client = session.create_client("sqs"), session.create_client("s3")
    bucket = f"weightstore-notify-{uuid.uuid4().hex[:8]}"
    s3_client.create_bucket(Bucket=bucket)
    queue = sqs.create_queue(QueueName=bucket)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    s3_client.put_bucket_notification_configuration(Bucket=bucket, NotificationConfiguration={
        "QueueConfigurations": [{"QueueArn": arn, "Events": ["s3:ObjectCreated:*"]}]})
    return f"s3://{bucket}/run", queue


def assert_woken_by_the_queue(folder: str, queue: str) -> None:
    """A follower polling every 30 s sees a publish within 15 s: the queue's event woke it."""
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    following = ws.follow(folder, poll=30, max_poll=30, timeout=60, notifications=queue)
    try:
        assert next(following).step == 1
        publisher = threading.Timer(0.5, lambda: ws.publish(folder, {"w": np.ones(4, np.float32)}, step=2))
        start = time.monotonic()
        publisher.start()
        assert next(following).step == 2
        assert time.monotonic() - start < 15  # polling alone would look again only after 30 s
        publisher.join()
    finally:
        following.close()


def test_a_notification_wakes_a_follower_long_before_its_next_look(notified):
    assert_woken_by_the_queue(*notified)


def test_a_failing_queue_falls_back_to_polling(notified, caplog):
    folder, queue = notified
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    following = ws.follow(folder, poll=0.05, max_poll=0.05, timeout=60, notifications=queue + "-missing")
    try:
        assert next(following).step == 1
        threading.Timer(1.0, lambda: ws.publish(folder, {"w": np.ones(4, np.float32)}, step=2)).start()
        assert next(following).step == 2  # found by polling while the queue fails
    finally:
        following.close()
    assert "polling only" in caplog.text


def test_a_queue_refusing_deletes_still_wakes_the_follower(notified, s3, caplog):
    folder, queue = notified

    def refuse_deletes(environ):
        if environ.get("HTTP_X_AMZ_TARGET", "").endswith(".DeleteMessageBatch"):
            return 400, b'{"__type": "AccessDenied", "message": "not allowed to delete"}'
        return None

    s3.intercept = refuse_deletes
    assert_woken_by_the_queue(folder, queue)  # the undeleted message only comes back later
    assert "not allowed to delete" in caplog.text


SERVING_PROCESS = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    from benchmarks.common import AnonPeak, anon_bytes
    from weightstore.adapters.serving.follower import Follower
    folder, tensors, floats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    variables = {f"layer_{i}/w": tf.Variable(np.full(floats, -1.0, np.float32)) for i in range(tensors)}
    with Follower(variables, folder, poll=0.01) as follower:
        print("ready", flush=True)
        anon = before = None
        for line in sys.stdin:  # the step just published
            step = int(line)
            assert follower.wait(step, timeout=120).step == step, follower.error
            assert all(np.all(var.numpy() == step + i) for i, var in enumerate(variables.values()))
            if anon is None:  # serving its first version: measure from here
                before, anon = anon_bytes(), AnonPeak(every=0.002).__enter__()
            print(step, flush=True)
    anon.__exit__()
    print(json.dumps({"extra": anon.peak - before}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_serving_process_holds_the_model_and_one_version_at_most(s3, folder, tmp_path, where, tf_fork):
    """Once serving, a process following 5 more versions of a 32 MB model (2 MB tensors) grows by
    at most about the version being staged: it once grew by twice the model on S3 (the staged
    version, the assign's copy of it, and the client's buffers of the body). The process is
    forked from one that imported TensorFlow (``conftest.tf_fork``), told each step through a FIFO."""
    target = folder if where == "s3" else str(tmp_path / "run")  # the child reaches the server as this process does
    tensors, floats = 16, (2 << 20) // 4
    model_bytes = tensors * floats * 4
    steps, said = tmp_path / "steps", tmp_path / "said"
    os.mkfifo(steps)
    os.mkfifo(said)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    serving = tf_fork.start(SERVING_PROCESS, target, str(tensors), str(floats), env=env, timeout=240, stdin=steps,
                            stdout=said)
    try:
        with open(said) as out, open(steps, "w") as into:  # the order the child opens them in
            assert out.readline().strip() == "ready"
            for step in range(1, 7):
                ws.publish(target, {f"layer_{i}/w": np.full(floats, step + i, np.float32) for i in range(tensors)},
                           step=step, keep=2)
                into.write(f"{step}\n")
                into.flush()
                assert out.readline().strip() == str(step)
            into.close()
            extra = json.loads(out.readline())["extra"]
    finally:
        done = serving()  # its input closed: it has ended, or ends now
        sys.stderr.write(done.stderr[-3000:])  # shown with a failed test's report
    assert done.returncode == 0
    assert extra < 1.6 * model_bytes, f"{extra / model_bytes:.2f}x the model"


def refusing(code: str, status: int):
    """A server intercept answering every request with S3's error ``code`` (a HEAD's, bodiless)."""
    body = f"<Error><Code>{code}</Code><Message>refused</Message></Error>".encode()
    return lambda environ: (status, b"" if environ["REQUEST_METHOD"] == "HEAD" else body)


def test_storage_failures_say_whether_they_pass(s3, folder, monkeypatch):
    """A follower waits out only what may pass: throttling, the service's faults, a server that
    is down; refused credentials stay until someone acts."""
    import s3fs

    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    for code, status, passes in [("SlowDown", 503, True), ("InternalError", 500, True),
                                 ("InvalidAccessKeyId", 403, False), ("AccessDenied", 403, False)]:
        s3.intercept = refusing(code, status)
        with pytest.raises(ws.StorageError) as raised:
            ws.latest(folder)
        assert raised.value.transient is passes, code
    s3.intercept = None
    with socket.socket() as closed:  # bound, never listening: every connection refused, as by a stopped server
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{closed.getsockname()[1]}")
        s3fs.S3FileSystem.clear_instance_cache()
        with pytest.raises(ws.StorageError) as raised:
            ws.latest(folder)
        assert raised.value.transient
    monkeypatch.undo()
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_refusal_after_the_folder_answered_is_waited_out(s3, folder, model):
    """Once the folder has answered, a refusal that looks permanent is as often one that passes
    (an expired token renewed, S3's 403 for a key pruned under a reader without ListBucket):
    a serving follower's ``wait`` and ``follow`` keep looking and take the next version."""
    def refused_for_a_second_then(step: int) -> threading.Timer:
        def answer_again() -> None:
            s3.intercept = None
            ws.publish(folder, weights_at(model, step), step=step)
        s3.intercept = refusing("InvalidAccessKeyId", 403)
        timer = threading.Timer(1.0, answer_again)
        timer.start()
        return timer

    ws.publish(folder, weights_at(model, 1), step=1)
    versions = ws.follow(folder, poll=0.05, timeout=60)
    with Follower(model, folder, poll=0.05) as follower:
        assert next(versions).step == 1 and follower.wait(timeout=60).step == 1
        timer = refused_for_a_second_then(2)
        try:
            assert follower.wait(step=2, timeout=60).step == 2
        finally:
            timer.join()
        assert next(versions).step == 2
        timer = refused_for_a_second_then(3)
        try:
            assert next(versions).step == 3
        finally:
            timer.join()
            s3.intercept = None


def test_refused_credentials_end_a_wait_and_ws_follow_at_once(s3, folder, model):
    """``wait()`` with no timeout, and ``ws follow``, waited a permanent failure out forever."""
    ws.publish(folder, weights_at(model, 3), step=3)
    s3.intercept = refusing("InvalidAccessKeyId", 403)
    with Follower(model, folder, poll=0.05) as follower, pytest.raises(ws.StorageError) as raised:
        follower.wait(timeout=60)  # the bug: None after the minute
    assert not raised.value.transient and folder in str(raised.value)
    ws_cli = os.path.join(os.path.dirname(sys.executable), "ws")
    done = subprocess.run([ws_cli, "follow", folder], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "InvalidAccessKeyId" not in done.stdout, done.stderr
    assert done.stderr.startswith("error: ") and folder in done.stderr, done.stderr
    s3.intercept = None
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/typo"
    done = subprocess.run([ws_cli, "follow", missing], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and missing in done.stderr, done.stderr
