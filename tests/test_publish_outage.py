"""A storage outage during training: the run goes on, and the final weights arrive once storage is back.

Against the loopback S3 server, which answers every request 503 while the outage lasts.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import weightstore as ws
from weightstore.sync import _stages as stages

BUCKET = "weightstore-outage"
DOWN = (503, b"<Error><Code>SlowDown</Code><Message>down</Message></Error>")


def weights(step: int) -> dict:
    return {"dense/kernel": np.full((3, 2), step, np.float32)}


@pytest.fixture
def outage(s3):
    """Starts and ends the outage; ends it in any case after 120 s, so a test cannot hang on it."""

    class Outage:
        def start(self):
            s3.intercept = lambda environ: DOWN

        def end(self):
            s3.intercept = None

    outage = Outage()
    safety = threading.Timer(120, outage.end)
    safety.start()
    yield outage
    safety.cancel()
    outage.end()


def test_a_background_publish_rides_out_an_outage(s3, outage):
    folder = f"s3://{BUCKET}/background"
    publisher = ws.BackgroundPublisher(folder, retry_backoff=0.1, max_backoff=0.5)
    assert publisher.publish(weights(1), step=1).result(60).step == 1
    outage.start()
    future = publisher.publish(weights(2), step=2)  # returns at once: nothing waits on storage
    while publisher.failures < 1:
        future.exception(0.05) if future.done() else threading.Event().wait(0.05)
    assert isinstance(publisher.last_error, ws.StorageError) and not future.done()
    outage.end()
    assert future.result(60).step == 2 and publisher.close().step == 2
    np.testing.assert_array_equal(ws.load(ws.latest(folder))["dense/kernel"], weights(2)["dense/kernel"])


@pytest.mark.slow  # an outage waited out
def test_the_end_of_an_outage_is_logged_once_as_its_start_is(s3, outage, caplog):
    """A log that ends on "failed; retrying" leaves whoever reads it wondering whether the run's
    weights ever arrived: the first version written after the outage says so, once."""
    folder = f"s3://{BUCKET}/outage-ends"
    publisher = ws.BackgroundPublisher(folder, retry_backoff=0.1, max_backoff=0.2)
    assert publisher.publish(weights(1), step=1).result(60).step == 1
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        outage.start()
        future = publisher.publish(weights(2), step=2)
        while publisher.failures < 3:  # retried, and a newer snapshot written instead
            threading.Event().wait(0.05)
        newer = publisher.publish(weights(3), step=3)
        assert "replaced it" in str(future.exception(60))  # given up for step 3 while the storage still fails
        outage.end()
        assert newer.result(60).step == 3
        assert publisher.publish(weights(4), step=4).result(60).step == 4  # no outage: nothing more said
    assert publisher.close().step == 4
    messages = [record.getMessage() for record in caplog.records]
    assert any("failed" in message and "retrying" in message for message in messages)
    again = [message for message in messages if "answers again" in message]
    assert len(again) == 1 and again[0].startswith(f"published step 3 to {folder}: the storage answers again, after ")


def test_a_wait_that_times_out_says_which_step_is_being_written_not_an_outage_long_over(s3, outage, monkeypatch, caplog):
    """The end of training logs what is still unpublished: a step waiting behind one being
    written says so, and the error of an outage that already ended is not given as its cause."""
    folder = f"s3://{BUCKET}/unfinished"
    publisher = ws.BackgroundPublisher(folder, retry_backoff=0.05)
    outage.start()
    future = publisher.publish(weights(1), step=1)
    while publisher.failures < 1:
        time.sleep(0.02)
    outage.end()
    assert future.result(60).step == 1 and publisher.last_error is not None  # an outage over
    gate, held = threading.Event(), []

    def hold(stage: str) -> None:  # holds the next publish at its "locked" stage until gate.set()
        if stage == "locked":
            held.append(stage)
            gate.wait(60)

    monkeypatch.setattr(stages, "hook", hold)
    publisher.publish(weights(2), step=2)
    while not held:
        time.sleep(0.01)
    publisher.publish(weights(3), step=3)
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        assert publisher.wait(0.2).step == 1
    said = [record.getMessage() for record in caplog.records if "is not published" in record.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"step 3 is not published to {folder} yet (waiting for step 2, "
                                                 "still being written)")
    gate.set()
    assert publisher.close(60).step == 3


def test_a_snapshot_is_given_up_after_retry_for_and_the_next_one_is_written(s3, outage):
    folder = f"s3://{BUCKET}/given-up"
    publisher = ws.BackgroundPublisher(folder, retry_for=0.5, retry_backoff=0.1)
    outage.start()
    given_up = publisher.publish(weights(1), step=1)
    with pytest.raises(ws.StorageError):
        given_up.result(60)
    assert publisher.failures >= 1 and publisher.wait() is None
    outage.end()
    assert publisher.publish(weights(2), step=2).result(60).step == 2


def test_fit_goes_on_through_an_outage_and_the_folder_ends_on_the_trained_weights(s3, outage):
    keras = pytest.importorskip("keras")
    from weightstore.adapters import tf2
    from weightstore.adapters.serving.hooks import PublishCallback

    folder = f"s3://{BUCKET}/fit"
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")

    class StartOutage(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                outage.start()

    callback = PublishCallback(folder, every_n_batches=2, end_timeout=0.5)
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[StartOutage(), callback])
    # fit returned while storage is still down: no exception, and the final weights still pending
    assert callback.last is None or callback.last.step < 32
    outage.end()
    assert callback.wait(60).step == 32
    for key, value in tf2.export(model).items():
        np.testing.assert_array_equal(ws.load(ws.latest(folder))[key], value)


def test_ws_follow_started_during_an_outage_waits_it_out(s3, outage):
    """The installed command: an outage at its start is waited out as one later on, not exit 1."""
    folder = f"s3://{BUCKET}/follow-from-an-outage"
    ws.publish(folder, weights(1), step=1)
    s3.reset()
    outage.start()
    follower = subprocess.Popen([sys.executable, "-m", "weightstore", "follow", folder, "--after", "1",
                                 "--timeout", "60", "--poll", "0.1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while s3.count() < 10:  # the command's looks, refused past what s3fs retries itself
            assert follower.poll() is None, follower.communicate()
            threading.Event().wait(0.05)
        outage.end()
        ws.publish(folder, weights(2), step=2)
        line = follower.stdout.readline()
    finally:
        follower.kill()
    _, err = follower.communicate()
    assert line.split() == ["2", f"{folder}/step-000000000002.npz"], err
    said = err.splitlines()  # the outage, when it started and when it ended: not once a retry
    started = [line for line in said if line.startswith("weightstore: waiting for")]  # not what the follow waits for
    assert len(started) == 1 and started[0].startswith(f"weightstore: waiting for {folder}: storage failed (") \
        and started[0].endswith("; retrying"), err
    assert [line for line in said if "answers again" in line] == [f"weightstore: {folder} answers again"], err
    assert "Traceback" not in err


DENIED = (403, b"<Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access Key Id you provided does not exist "
               b"in our records.</Message></Error>")


def test_credentials_refused_before_the_folder_ever_answered_give_the_snapshot_up_at_once(s3, caplog):
    """Retried for retry_for (600 s) as an outage, refused credentials held every snapshot
    while training went on, with nothing said but "retrying"; as follow does, a refusal before
    the first answer is given up at once, and the next snapshot tries again."""
    folder = f"s3://{BUCKET}/refused"
    publisher = ws.BackgroundPublisher(folder)  # retry_for: 600 s
    s3.intercept = lambda environ: DENIED
    with caplog.at_level(logging.ERROR, logger="weightstore"):
        error = publisher.publish(weights(1), step=1).exception(60)  # at once: well under retry_for
    assert isinstance(error, ws.StorageError) and not error.transient and publisher.failures == 1
    assert any(folder in record.getMessage() and "Access Key Id" in record.getMessage()  # folder and cause
               and "before the folder ever answered" in record.getMessage() for record in caplog.records)
    assert isinstance(publisher.publish(weights(2), step=2).exception(60), ws.StorageError)  # training goes on
    s3.intercept = None  # the credentials fixed
    assert publisher.publish(weights(3), step=3).result(60).step == 3 and publisher.close(60).step == 3


def test_a_bucket_that_does_not_exist_gives_the_snapshot_up_at_once(s3):
    import s3fs

    folder = "s3://weightstore-not-made-yet/run"
    publisher = ws.BackgroundPublisher(folder)
    error = publisher.publish(weights(1), step=1).exception(60)
    assert isinstance(error, ws.StorageError) and not error.transient and folder in str(error)
    s3fs.S3FileSystem().mkdir("weightstore-not-made-yet")
    assert publisher.publish(weights(2), step=2).result(60).step == 2 and publisher.close(60).step == 2


def test_a_bucket_removed_once_the_folder_answered_is_retried(s3):
    """Once the folder has answered, a refusal that looks permanent is more often one that
    passes: it is retried as an outage is."""
    import s3fs

    bucket = "weightstore-removed-mid-run"
    fs = s3fs.S3FileSystem()
    fs.mkdir(bucket)
    folder = f"s3://{bucket}/run"
    publisher = ws.BackgroundPublisher(folder, retry_backoff=0.05, max_backoff=0.2)
    assert publisher.publish(weights(1), step=1).result(60).step == 1
    fs.rm(bucket, recursive=True)
    future = publisher.publish(weights(2), step=2)
    while publisher.failures < 2:
        assert not future.done(), future.exception()
        threading.Event().wait(0.05)
    assert not publisher.last_error.transient and not future.done()
    fs.mkdir(bucket)
    assert future.result(60).step == 2 and publisher.close(60).step == 2


def test_a_write_cut_off_by_the_server_dying_mid_upload_is_retried_once_it_is_back_and_lands_whole(s3, caplog):
    """The server is killed while the version's bytes are on their way (its connection reset, no
    answer: an error with no errno, and no service answer), then restarted with what it stored:
    the publisher retries, and the version that lands is the whole one, bit-exact."""
    caplog.set_level(logging.WARNING, logger="weightstore")
    import s3fs

    folder = f"s3://{BUCKET}/killed-mid-upload"
    value = {"dense/kernel": np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)}  # 4 MiB
    killed = threading.Event()

    def kill_mid_upload(environ):
        if environ["REQUEST_METHOD"] == "PUT" and "/step-" in environ["PATH_INFO"] and not killed.is_set():
            environ["wsgi.input"].read(1 << 16)  # the first bytes of the body arrived
            killed.set()
            s3.kill(environ)
            return 500, b""  # never sent: the connection is reset
        return None

    s3.intercept = kill_mid_upload
    publisher = ws.BackgroundPublisher(folder, retry_backoff=0.1, max_backoff=0.5)
    try:
        future = publisher.publish(value, step=1)
        deadline = time.monotonic() + 60
        while publisher.failures < 1:
            assert not future.done(), future.exception()
            assert time.monotonic() < deadline, "the cut-off upload was never reported as a failure"
            threading.Event().wait(0.05)
        error = publisher.last_error  # the cut upload's, or a retry's that found the server still down
        assert killed.is_set() and isinstance(error, ws.StorageError) and error.transient, error
        cut = [record.args[2] for record in caplog.records if "retrying" in record.getMessage()][0]
        assert isinstance(cut, ws.StorageError) and not cut.errno and "step-000000000001" in str(cut), cut
    finally:  # the module's server serves its other tests again, whatever happened here
        s3.intercept = None
        if killed.is_set():
            s3.restart()
    assert future.result(60).step == 1 and publisher.close(60).step == 1
    got = ws.load(ws.latest(folder))  # every checksum verified
    assert got["dense/kernel"].tobytes() == value["dense/kernel"].tobytes()
    s3fs.S3FileSystem.clear_instance_cache()
    names = sorted(path.rpartition("/")[2] for path in s3fs.S3FileSystem().ls(folder, refresh=True))
    assert names == ["LATEST", "step-000000000001.npz"], names


ENDS_DURING_AN_OUTAGE = """
import sys
import keras
import numpy as np
from weightstore.adapters.serving.hooks import PublishCallback

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
callback = PublishCallback(sys.argv[1], end_timeout=0, retry_for=float(sys.argv[2]))
x = np.ones((8, 3), np.float32)
model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[callback])
print("fit returned", callback.failures, flush=True)
"""


def test_a_script_ends_within_the_callbacks_retry_for_while_the_storage_stays_down(s3, outage, tf_fork):
    """The process waits at exit for a publish still retrying, ``retry_for`` at most: a callback's
    own ``retry_for`` bounds that wait (600 s otherwise) while the final weights are given up."""
    outage.start()
    done = tf_fork.run(ENDS_DURING_AN_OUTAGE, f"s3://{BUCKET}/ends", "1", env={**os.environ, **s3.environment()},
                       timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fit returned" in done.stdout and "given up" in done.stderr and "Traceback" not in done.stderr


ENDS_WITH_A_PUBLISH_RETRYING = """
import sys, threading
import numpy as np
import weightstore as ws
from weightstore.sync import _stages as stages

threading._register_atexit(lambda: print("exiting", flush=True))  # runs just before the exit's wait
publisher = ws.BackgroundPublisher(sys.argv[1], retry_for=60, retry_backoff=0.1, max_backoff=0.2)
publisher.publish({"dense/kernel": np.ones((3, 2), np.float32)}, step=1)
"""


def test_ctrl_c_while_the_exit_waits_for_a_retrying_publish_gives_it_up_and_says_so(s3, outage):
    """A script ended during an outage waits at exit for its publish, and says so as it begins to
    (with how to end it: no process that looks hung); Ctrl-C ends that wait: one line names the
    step left unpublished, and no traceback of weightstore's shows."""
    folder = f"s3://{BUCKET}/interrupted"
    outage.start()
    script = subprocess.Popen([sys.executable, "-c", ENDS_WITH_A_PUBLISH_RETRYING, folder], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while not any("retrying" in line for line in seen):  # logged by the publishing thread
            seen.append(script.stderr.readline())
            assert seen[-1], "".join(seen)
        assert script.stdout.readline() == "exiting\n", "".join(seen)  # the main thread is at the exit's wait
        while not any("the process waits at exit" in line for line in seen):  # said once, before or after
            seen.append(script.stderr.readline())  # a retry's line
            assert seen[-1], "".join(seen)
        said = next(line for line in seen if "the process waits at exit" in line)
        assert f"while publishing step 1 to {folder} is retried" in said, "".join(seen)
        assert "given up after retry_for=60 s of failures); Ctrl-C gives it up now" in said, "".join(seen)
        script.send_signal(signal.SIGINT)
        _, err = script.communicate(timeout=60)
    finally:
        script.kill()
    assert f"interrupted at exit: step 1 is not published to {folder}" in err, err
    assert "Traceback" not in err, err
    outage.end()
    assert ws.latest(folder) is None  # given up: nothing was written once the storage came back


def test_a_first_publish_whose_latest_write_failed_is_completed_by_the_retry(s3, caplog):
    """The first publish to an empty folder lands its version, then S3 fails ``LATEST``'s PUT (a
    500): the landed file must not count as a newer version refusing the retry of its own step.
    The failure's log line names the folder once, not again inside the storage's error."""
    folder = f"s3://{BUCKET}/first-latest-fails"
    failed = s3.fail_once("PUT", "LATEST")
    publisher = ws.BackgroundPublisher(folder, retry_backoff=0.05, max_backoff=0.2)
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        assert publisher.publish(weights(1), step=1).result(60).step == 1
    assert failed.is_set() and publisher.failures == 1 and publisher.close(60).step == 1
    retrying = [record.getMessage() for record in caplog.records if "retrying" in record.getMessage()]
    assert len(retrying) == 1 and retrying[0].startswith(f"publishing step 1 to {folder} failed (storage failed (")
    assert retrying[0].count(folder) == 1, retrying
    np.testing.assert_array_equal(ws.load(ws.latest(folder))["dense/kernel"], weights(1)["dense/kernel"])
