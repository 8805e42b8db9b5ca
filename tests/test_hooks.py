"""Trainer-side hooks (Keras callback, TF1 SessionRunHook) and the inference-side Follower."""

import json
import os
import threading
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import weightstore as ws  # noqa: E402
from polling import wait_until  # noqa: E402
from weightstore import sync as versions  # noqa: E402
from weightstore.adapters import tf1, tf2  # noqa: E402
from weightstore.adapters.serving.follower import Follower  # noqa: E402
from weightstore.adapters.serving.hooks import PublishCallback, PublishHook, is_chief  # noqa: E402
from weightstore.sync import _stages as stages  # noqa: E402


def small_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(1, name="out")])
    model.compile(optimizer="sgd", loss="mse")
    return model


def fit(model, callback, epochs: int = 2) -> None:
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    model.fit(x, x[:, :1], batch_size=8, epochs=epochs, verbose=0, callbacks=[callback])  # 4 batches an epoch


def test_keras_callback_publishes_every_n_batches(tmp_path):
    """Each interval is a version (in the background a snapshot waiting behind a slow one gives way
    to a newer one: the test below), so this one publishes in the training thread."""
    model = small_model()
    callback = PublishCallback(tmp_path, every_n_batches=3, keep=None, metadata={"run": "a"}, background=False)
    fit(model, callback)
    assert [e.step for e in versions.list_versions(tmp_path)] == [3, 6, 8]  # and the end of fit
    latest = ws.latest(tmp_path)
    assert latest.metadata == {"run": "a", "epoch": 1} and callback.last.step == 8
    for key, value in tf2.export(model).items():
        np.testing.assert_array_equal(ws.load(latest)[key], value)  # exactly the trained weights


@pytest.mark.parametrize("background", [False, True])
def test_keras_callback_ends_on_the_trained_weights_when_the_interval_does_not_divide_the_run(tmp_path, background):
    model = small_model()
    x = np.random.default_rng(0).normal(size=(384, 3)).astype(np.float32)
    callback = PublishCallback(tmp_path, every_n_batches=25, keep=None, background=background)
    model.fit(x, x[:, :1], batch_size=1, epochs=1, verbose=0, callbacks=[callback])
    steps = [e.step for e in versions.list_versions(tmp_path)]
    if background:  # a snapshot waiting while another is written gives way to a newer one
        assert steps[-1] == 384 and all(step % 25 == 0 for step in steps[:-1]) and steps == sorted(steps)
    else:
        assert steps == [*range(25, 376, 25), 384]
    for key, value in tf2.export(model).items():
        np.testing.assert_array_equal(ws.load(ws.latest(tmp_path))[key], value)


def test_keras_callback_counts_batches_as_model_checkpoint_does_under_steps_per_execution(tmp_path):
    model = small_model()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=8)
    x = np.random.default_rng(0).normal(size=(96, 3)).astype(np.float32)
    # in the foreground: a background publisher may replace a pending snapshot by a newer one
    callback = PublishCallback(tmp_path, every_n_batches=20, keep=None, at_end=False, background=False)
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}-{batch}.weights.h5"), save_freq=20,
                                                 save_weights_only=True)
    model.fit(x, x[:, :1], batch_size=2, epochs=2, verbose=0, callbacks=[callback, checkpoint])  # 48 steps an epoch
    steps = [e.step for e in versions.list_versions(tmp_path)]
    assert steps and len(steps) == len(list(tmp_path.glob("ckpt-*.weights.h5")))  # as many as Keras's own
    assert all(step % 8 == 0 for step in steps)  # at the ends of executions, where Keras reports


def test_a_foreground_callback_leaves_digests_out_of_versions_whose_every_weight_changed(tmp_path):
    """On the training thread as in the background: a version whose every weight changed since
    the last carries no content digests (none could match); one where a weight did not change
    carries every tensor's, and a follower assigning each version in turn ends on each."""
    from weightstore.core.manifest import content_digest

    model = small_model()
    bias = model.get_layer("out").bias
    kept: dict[str, np.ndarray] = {}

    def hold_the_bias(epoch, logs):  # before the publish: step 20's out/bias is step 16's
        if epoch == 4:
            bias.assign(kept["bias"])
        kept["bias"] = bias.numpy()

    held = keras.callbacks.LambdaCallback(on_epoch_end=hold_the_bias)
    callback = PublishCallback(tmp_path, keep=None, background=False)
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    model.fit(x, x[:, :1], batch_size=8, epochs=6, verbose=0, callbacks=[held, callback])
    found = versions.list_versions(tmp_path)
    assert [e.step for e in found] == [4, 8, 12, 16, 20, 24]
    follower = small_model(seed=1)
    recorded = []
    for entry in found:
        with ws.open(entry.path) as store:
            weights = {key: store[key] for key in store}
            digests = {key: store.info(key).digest for key in store}
        recorded.append(set(digests.values()) != {None})
        if recorded[-1]:
            assert digests == {key: "blake3:" + content_digest(value).hex() for key, value in weights.items()}
        tf2.assign(follower, entry.path)
        for key, value in tf2.export(follower).items():
            np.testing.assert_array_equal(value, weights[key])
    # 4: nothing to compare with; 8: all changed, hashed on the guess from 4; 12, 16: all changed;
    # 20: out/bias unchanged (hashed after all); 24: all changed, hashed on the guess from 20
    assert recorded == [True, True, False, False, True, True]
    for key, value in tf2.export(model).items():
        np.testing.assert_array_equal(tf2.export(follower)[key], value)  # the follower ends on the trained weights


@pytest.mark.parametrize(("options", "what"), [({"every_n_epochs": 5}, "only the end of fit publishes"),
                                               ({"every_n_batches": 100, "at_end": False}, "nothing is published")])
def test_keras_callback_says_when_its_interval_never_triggers(tmp_path, options, what):
    with pytest.warns(UserWarning, match=f"never triggers in a fit of 2 epochs of 4 steps: {what}"):
        fit(small_model(), PublishCallback(tmp_path, keep=None, **options))
    assert [e.step for e in versions.list_versions(tmp_path)] == ([8] if "end" in what else [])


def test_keras_callback_every_epoch_by_default_and_final_weights(tmp_path):
    model = small_model()
    fit(model, PublishCallback(tmp_path, keep=None))
    assert [e.step for e in versions.list_versions(tmp_path)] == [4, 8]
    for key, value in tf2.export(model).items():
        np.testing.assert_array_equal(ws.load(ws.latest(tmp_path))[key], value)


def test_keras_callback_publishes_on_the_chief_only(tmp_path, monkeypatch):
    cluster = {"worker": ["a:1", "b:1"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    fit(small_model(), PublishCallback(tmp_path / "run"))
    assert ws.latest(tmp_path / "run") is None


@pytest.mark.parametrize("config, chief", [
    ({}, True),
    ({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 0}}, True),
    ({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 1}}, False),
    ({"cluster": {"chief": ["c"], "worker": ["a"]}, "task": {"type": "worker", "index": 0}}, False),
    ({"cluster": {"chief": ["c"], "worker": ["a"]}, "task": {"type": "chief", "index": 0}}, True),
    ({"cluster": {"ps": ["p"], "worker": ["a"]}, "task": {"type": "ps", "index": 0}}, False),
    ({"cluster": {"master": ["m"], "worker": ["a"]}, "task": {"type": "master", "index": 0}}, True),
    ({"cluster": {"master": ["m"], "worker": ["a"]}, "task": {"type": "worker", "index": 0}}, False),
    ({"cluster": {"chief": ["c"], "worker": ["a"], "evaluator": ["e"]}, "task": {"type": "evaluator"}}, False),
    ({"task": {"type": "chief", "index": 0}}, True),  # no cluster: the chief still publishes
    ({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": "0"}}, True),  # as TF reads an index
])
def test_is_chief_from_tf_config(monkeypatch, config, chief):
    """The task that publishes is rank 0 of the numbering sharded versions use: one rule for both."""
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert is_chief() is chief
    if chief and config.get("cluster"):  # where the cluster lists the task, it is rank 0 of a sharded version
        assert ws.sharded.membership().rank == 0


def test_a_malformed_tf_config_is_named(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ws.errors.WeightStoreError, match="TF_CONFIG is not a cluster and task"):
        is_chief()


def test_keras_callback_rejects_bad_intervals(tmp_path):
    with pytest.raises(ValueError, match="every_n_batches"):
        PublishCallback(tmp_path, every_n_batches=0)


@pytest.mark.parametrize("background", [True, False])
def test_a_bad_retry_for_is_refused_whether_the_hook_publishes_in_the_background_or_not(tmp_path, background):
    with pytest.raises(ValueError, match="retry_for must be seconds"):
        PublishCallback(tmp_path, background=background, retry_for=-1)
    with pytest.raises(ValueError, match="retry_for must be seconds"):
        PublishHook(tmp_path, every_n_steps=1, background=background, retry_for=float("nan"))


def tf1_training(folder, hook_options: dict, steps: int = 10):
    """A tiny TF1 trainer under MonitoredTrainingSession; returns the final variable values."""
    with tf.Graph().as_default():
        global_step = tf.compat.v1.train.get_or_create_global_step()
        with tf.compat.v1.variable_scope("model"):
            w = tf.compat.v1.get_variable("w", initializer=tf.zeros([3]))
        train = tf.group(w.assign_add(tf.ones([3])), global_step.assign_add(1))
        hook = PublishHook(folder, **hook_options)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook], checkpoint_dir=None) as sess:
            for _ in range(steps):
                sess.run(train)
    return hook


@pytest.mark.parametrize("background", [False, True])
def test_session_run_hook_publishes_every_n_steps_and_at_the_end(tmp_path, background):
    hook = tf1_training(tmp_path, {"every_n_steps": 4, "keep": None, "include": "model", "background": background})
    steps = [e.step for e in versions.list_versions(tmp_path)]
    if background:  # a snapshot that waits while another is written is replaced by a newer one:
        # the newest wins, so which of the earlier ones land depends on the machine's pace
        assert steps[-1] == 10 and steps == sorted(steps) and set(steps) <= {1, 5, 9, 10}
    else:
        assert steps == [1, 5, 9, 10]
    loaded = ws.load(ws.latest(tmp_path))
    assert list(loaded) == ["model/w"] and np.all(loaded["model/w"] == 10)
    for entry in versions.list_versions(tmp_path):
        assert np.all(ws.load(entry.path)["model/w"] == entry.step)
    assert hook.last.step == 10


def test_session_run_hook_not_chief_publishes_nothing(tmp_path):
    tf1_training(tmp_path / "run", {"every_n_steps": 1, "is_chief": False})
    assert ws.latest(tmp_path / "run") is None


def test_session_run_hook_needs_one_interval(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        PublishHook(tmp_path)


# --- publishing in the background ------------------------------------------------------------

@pytest.fixture
def gate(monkeypatch):
    """Holds the first publish at its "locked" stage (before any tensor is read) until ``gate.set()``."""
    opened = threading.Event()
    released = []

    def stage(name: str) -> None:
        if name == "locked" and not released:
            released.append(opened.wait(60))  # False: nobody opened it, the trainer was blocked

    monkeypatch.setattr(stages, "hook", stage)
    opened.released = released
    yield opened
    opened.set()


class Recorder(keras.callbacks.Callback):
    """Copies the weights at every step and opens ``gate`` once training is ``after`` steps past the first publish."""

    def __init__(self, gate=None, opens_at: int | None = None):
        super().__init__()
        self.values = {}
        self.gate, self.opens_at = gate, opens_at

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        self.values[step] = tf2.export(self.model)
        if step == self.opens_at:
            self.gate.set()


def test_keras_callback_publishes_the_snapshot_while_training_goes_on(tmp_path, gate):
    model = small_model()
    recorder = Recorder(gate, opens_at=7)  # three steps after the publish of step 4 began
    callback = PublishCallback(tmp_path, every_n_batches=4, keep=None)
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[recorder, callback])
    assert gate.released == [True]  # the trainer went on to step 7 while step 4 was being written
    assert [e.step for e in versions.list_versions(tmp_path)] == [4, 8]
    first = ws.load(versions.list_versions(tmp_path)[0].path)
    assert sorted(first) == sorted(recorder.values[4])
    for key, value in recorder.values[4].items():
        np.testing.assert_array_equal(first[key], value)  # the values of step 4, not of step 7
    assert any(not np.array_equal(recorder.values[4][k], recorder.values[7][k]) for k in first)
    # fit returned with the last version complete
    assert callback.last.step == 8 and ws.latest(tmp_path).step == 8 and callback.wait().step == 8
    for key, value in tf2.export(model).items():
        np.testing.assert_array_equal(ws.load(ws.latest(tmp_path))[key], value)


def test_keras_callback_without_background_publishes_before_the_step_returns(tmp_path):
    seen = []

    class Check(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if step % 2 == 0:
                seen.append((step, ws.latest(tmp_path).step))

    model = small_model()
    x = np.zeros((32, 3), np.float32)
    callback = PublishCallback(tmp_path, every_n_batches=2, background=False)
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0, callbacks=[callback, Check()])
    assert seen == [(2, 2), (4, 4)] and callback.last.step == 4


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_publish_never_reaches_fit_and_is_counted(tmp_path, background, caplog):
    ws.publish(tmp_path, {"other": np.zeros(1, np.float32)}, step=100)  # another trainer's folder
    callback = PublishCallback(tmp_path, every_n_batches=2, background=background)
    fit(small_model(), callback, epochs=1)  # returns: publishes of steps 2 and 4 fail
    assert callback.failures >= 1 and isinstance(callback.last_error, ws.PublishError)
    assert "is not after step 100" in str(callback.last_error)
    assert ws.latest(tmp_path).step == 100 and callback.last is None
    assert any("the last version published is none" in record.getMessage() for record in caplog.records)


def test_session_run_hook_writes_in_the_background_while_training_goes_on(tmp_path, gate):
    with tf.Graph().as_default():
        global_step = tf.compat.v1.train.get_or_create_global_step()
        w = tf.compat.v1.get_variable("w", initializer=tf.zeros([3]))
        train = tf.group(w.assign_add(tf.ones([3])), global_step.assign_add(1))
        hook = PublishHook(tmp_path, every_n_steps=4, keep=None)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook], checkpoint_dir=None) as sess:
            for done in range(10):
                if done == 3:
                    gate.set()  # two steps past the first publish (step 1), which is still held
                sess.run(train)
    assert gate.released == [True]
    entries = versions.list_versions(tmp_path)
    assert entries[-1].step == 10 and hook.last.step == 10  # end() waited for the last one
    for entry in entries:
        assert np.all(ws.load(entry.path)["w"] == entry.step)


def test_session_run_hook_never_raises_a_failed_publish_into_the_session(tmp_path):
    ws.publish(tmp_path, {"other": np.zeros(1, np.float32)}, step=100)
    hook = tf1_training(tmp_path, {"every_n_steps": 100})
    assert hook.failures >= 1 and "steps must increase" in str(hook.last_error)
    assert ws.latest(tmp_path).step == 100


# --- the inference side -----------------------------------------------------------------------

def step_weights(model, step: int, changed=None) -> dict:
    """Every tensor holds ``step``, or only the keys in ``changed`` do (the rest hold 0)."""
    return {key: np.full(value.shape, step if changed is None or key in changed else 0, value.dtype)
            for key, value in tf2.export(model).items()}


@pytest.mark.parametrize("delta", [False, True])
def test_a_torch_follower_serves_a_keras_trainers_versions_with_layout_keras(tmp_path, delta):
    """The cross-framework sync the library is for: Keras trains and publishes, a torch module
    follows with ``layout="keras"`` (kernels transposed, batch norm renamed), as ``torch.assign``
    takes it; a TF target, whose versions need no layout, is refused naming the option."""
    torch = pytest.importorskip("torch")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="hidden"),
                              keras.layers.BatchNormalization(name="norm"), keras.layers.Dense(1, name="out")])
    model.compile(optimizer="sgd", loss="mse")

    class Served(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden, self.norm, self.out = torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4, eps=1e-3), torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.norm(self.hidden(x)))

    served = Served().eval()
    x = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    with Follower(served, tmp_path, poll=0.005, layout="keras") as follower:
        for _ in range(2):  # a second version: unchanged tensors skipped, a delta applied onto the copy held
            fit(model, PublishCallback(tmp_path, delta=delta), epochs=1)
            assert follower.wait(int(model.optimizer.iterations), timeout=60).step == int(model.optimizer.iterations)
            with follower.reading(), torch.no_grad():
                np.testing.assert_allclose(served(torch.from_numpy(x)).numpy(), model(x, training=False), atol=1e-5)
    assert follower.error is None
    with pytest.raises(ws.UnsupportedTargetError, match="layout= converts versions for torch and Flax targets; "
                       r".*publish export\(module, layout='keras'\)"):
        Follower(model, tmp_path, layout="keras")
    with pytest.raises(ws.errors.LayoutError, match=f"^{tmp_path}: unknown layout 'kerass'"):
        Follower(served, tmp_path, layout="kerass")  # at once, not on every version


def test_follower_swaps_tf2_model_between_calls_and_skips_unchanged(tmp_path):
    model = small_model()
    keys = sorted(tf2.export(model))
    ws.publish(tmp_path, step_weights(model, 1), step=1)
    torn = []
    stop = threading.Event()

    def inference():
        while not stop.is_set():
            with follower.reading():
                first = float(model.variables[0].numpy().flat[0])
                time.sleep(0.001)  # a swap now would tear this call
                values = {float(v.numpy().flat[0]) for v in model.variables}
            if values != {first}:
                torn.append(values)

    with Follower(model, tmp_path, poll=0.005) as follower:
        assert follower.wait(1, timeout=30).step == 1
        readers = [threading.Thread(target=inference) for _ in range(2)]
        for reader in readers:
            reader.start()
        for step in range(2, 12):
            ws.publish(tmp_path, step_weights(model, step), step=step, keep=2)
            assert follower.wait(step, timeout=30).step == step
        stop.set()
        for reader in readers:
            reader.join()
        assert not torn
        assert sorted(follower.report.assigned) == keys and follower.report.skipped == []
        head = [key for key in keys if key.startswith("out/")]
        ws.publish(tmp_path, {**step_weights(model, 11), **{k: v + 1 for k, v in step_weights(model, 11, head).items()
                                                           if k in head}}, step=12)
        follower.wait(12, timeout=30)
        assert sorted(follower.report.assigned) == head and sorted(follower.report.skipped) == sorted(set(keys) - set(head))
        assert follower.run(lambda: float(model.get_layer("out").kernel.numpy().flat[0])) == 12.0
        assert follower.error is None


def test_follower_keeps_tf1_session_current_without_growing_the_graph(tmp_path):
    with tf.Graph().as_default() as graph:
        w = tf.compat.v1.get_variable("w", initializer=tf.zeros([3]))
        b = tf.compat.v1.get_variable("b", initializer=tf.zeros([2]))
        out = tf.reduce_sum(w) + tf.reduce_sum(b)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            ws.publish(tmp_path, {"w": np.full(3, 1, np.float32), "b": np.full(2, 1, np.float32)}, step=1)
            with Follower(sess, tmp_path, poll=0.005) as follower:
                follower.wait(1, timeout=30)
                ops = len(graph.get_operations())
                for step in range(2, 8):
                    ws.publish(tmp_path, {"w": np.full(3, step, np.float32), "b": np.full(2, 1, np.float32)},
                               step=step, keep=2)
                    follower.wait(step, timeout=30)
                    assert follower.run(sess.run, out) == 3 * step + 2
                    assert follower.report.skipped == ["b"]
                assert len(graph.get_operations()) == ops
                assert follower.error is None


def test_follower_records_a_version_that_does_not_fit(tmp_path):
    model = small_model()
    ws.publish(tmp_path, {"unrelated": np.zeros(2, np.float32)}, step=1)
    with Follower(model, tmp_path, poll=0.005) as follower:
        with pytest.raises(ws.AssignmentError):  # raised, not a wait until the timeout (that returns None)
            follower.wait(timeout=10)
        assert isinstance(follower.error, ws.AssignmentError) and follower.version is None
        with pytest.raises(ws.AssignmentError):  # still failed: raises at once
            follower.wait(1, timeout=10)
        ws.publish(tmp_path, step_weights(model, 2), step=2)  # then wait for it at once: step 1's failure
        assert follower.wait(2, timeout=30).step == 2 and follower.error is None  # says nothing of step 2


def test_a_follower_refuses_a_file_for_a_folder_and_a_wait_before_it_follows(tmp_path):
    """Both waited for good: a file never becomes a folder of versions, and an unstarted
    follower never assigns."""
    model = small_model()
    ws.publish(tmp_path / "run", step_weights(model, 1), step=1)
    idle = Follower(model, tmp_path / "run")
    with pytest.raises(RuntimeError, match="not following: start it"):
        idle.wait(timeout=30)
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(ws.StoreNotFoundError, match="is a file, not a folder of versions"):
        Follower(model, tmp_path / "a-file").start()
    with pytest.raises(ws.StoreNotFoundError, match="is a file, not a folder of versions"):
        next(iter(ws.follow(tmp_path / "a-file")))
    with pytest.raises(ws.StoreNotFoundError, match="is a file, not a folder of versions"):
        ws.latest(tmp_path / "a-file")


def test_wants_skip_by_type_not_by_name():
    from weightstore.adapters._reload import wants_skip

    class Subclassed(ws.Version):
        pass

    class Version:  # only the name
        path = "x.npz"

    assert wants_skip(Subclassed(1, "x.npz", ""), None) is True
    assert wants_skip(Version(), None) is False
    assert wants_skip(Version(), True) is True and wants_skip(Subclassed(1, "x.npz", ""), False) is False


# --- hot reload after the target was changed outside weightstore ---------------------------------

def test_tf1_forget_after_an_initializer_rewrote_the_variables(tmp_path):
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.zeros([3]))
        init = tf.compat.v1.global_variables_initializer()
        with tf.compat.v1.Session() as sess:
            sess.run(init)
            same = {"w": np.full(3, 7, np.float32)}
            assert tf1.assign(sess, ws.publish(tmp_path, same, step=1)).assigned == ["w"]
            sess.run(init)  # back to zeros behind weightstore's back
            stale = tf1.assign(sess, ws.publish(tmp_path, same, step=2))
            assert stale.skipped == ["w"] and np.all(sess.run(w) == 0)  # the caveat the docstrings state
            tf1.forget(sess)
            report = tf1.assign(sess, ws.latest(tmp_path))
            assert (report.assigned, report.skipped) == (["w"], []) and np.all(sess.run(w) == 7)
            assert tf1.assign(sess, ws.publish(tmp_path, same, step=3)).skipped == ["w"]  # remembered again


def test_tf2_forget_after_the_variables_were_changed(tmp_path):
    model = small_model()
    weights = step_weights(model, 5)
    keys = sorted(weights)
    assert sorted(tf2.assign(model, ws.publish(tmp_path, weights, step=1)).assigned) == keys
    for var in model.variables:
        var.assign(np.zeros(var.shape, np.float32))  # e.g. training in place
    stale = tf2.assign(model, ws.publish(tmp_path, weights, step=2))
    assert sorted(stale.skipped) == keys and all(np.all(v.numpy() == 0) for v in model.variables)
    tf2.forget(model)
    report = tf2.assign(model, ws.latest(tmp_path))
    assert (sorted(report.assigned), report.skipped) == (keys, [])
    assert all(np.all(v.numpy() == 5) for v in model.variables)
    tf2.forget(model.get_layer("out"))  # a part of the model: only its variables are written next time
    report = tf2.assign(model, ws.publish(tmp_path, weights, step=3))
    assert sorted(report.assigned) == [k for k in keys if k.startswith("out/")]


def test_tf2_forget_forgets_the_optimizer_state_training_changed_too(tmp_path):
    def compiled() -> keras.Model:
        model = small_model()
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
        return model

    x, y = np.ones((8, 3), np.float32), np.zeros((8, 1), np.float32)
    source = compiled()
    source.fit(x, y, verbose=0)
    version = ws.publish(tmp_path, tf2.export(source, optimizer=True), step=1)
    model = compiled()
    tf2.assign(model, version, optimizer=True)
    model.fit(x, y, verbose=0)  # moves the weights, the step and Adam's slots
    tf2.forget(model)
    report = tf2.assign(model, version, optimizer=True)
    assert report.skipped == [] and len(report.assigned) == len(tf2.keys(model, optimizer=True))
    assert int(model.optimizer.iterations.numpy()) == int(source.optimizer.iterations.numpy()) == 1
    exported = tf2.export(model, optimizer=True)
    for key, value in tf2.export(source, optimizer=True).items():
        np.testing.assert_array_equal(exported[key], value)


def test_follower_error_from_a_damaged_folder_clears_once_it_reads_cleanly(tmp_path):
    model = small_model()
    ws.publish(tmp_path, step_weights(model, 1), step=1)
    with Follower(model, tmp_path, poll=0.005) as follower:
        assert follower.wait(1, timeout=30).step == 1
        pointer = (tmp_path / "LATEST").read_bytes()
        (tmp_path / "LATEST").write_bytes(b"garbage")
        wait_until(lambda: follower.error is not None, what="the follower seeing the damage")
        assert isinstance(follower.error, ws.FormatError)
        (tmp_path / "LATEST").write_bytes(pointer)  # repaired: the folder reads cleanly again
        wait_until(lambda: follower.error is None, what="the follower's error clearing")
        assert follower.error is None
        assert follower.wait(2, timeout=0.3) is None  # waits for step 2 instead of raising the old error


def test_a_latest_that_stays_unreadable_is_said_once_by_the_follower(tmp_path, caplog, monkeypatch):
    """``LATEST`` a link loop for many looks: the Follower logged "following failed" at every
    poll. It is said once, as an outage is, and once when the folder answers again."""
    from weightstore.sync import _follow

    looks = []
    counted = _follow.read_latest
    monkeypatch.setattr(_follow, "read_latest", lambda source: looks.append(1) or counted(source))
    model = small_model()
    ws.publish(tmp_path, step_weights(model, 1), step=1)
    with Follower(model, tmp_path, poll=0.005, max_poll=0.005) as follower:
        assert follower.wait(1, timeout=30).step == 1
        with caplog.at_level("WARNING", logger="weightstore"):
            os.rename(tmp_path / "LATEST", tmp_path / "LATEST.good")
            os.symlink("LATEST", tmp_path / "LATEST")
            wait_until(lambda: follower.error is not None, what="the follower seeing the loop")
            seen = len(looks)
            wait_until(lambda: len(looks) >= seen + 5, what="five more looks at LATEST")
            assert isinstance(follower.error, ws.FileAccessError)
            os.remove(tmp_path / "LATEST")
            os.rename(tmp_path / "LATEST.good", tmp_path / "LATEST")
            wait_until(lambda: follower.error is None, what="the follower's error clearing")
    said = [record.getMessage() for record in caplog.records]
    assert sum("LATEST: cannot be opened" in line for line in said) == 1, said
    assert sum("answers again" in line for line in said) == 1, said


def test_a_bug_in_the_followers_look_is_said_once_with_its_traceback(tmp_path, caplog, monkeypatch):
    """A failure that is no storage's or folder's (a reader's leaked ValueError, a bug) is logged
    with its traceback, once while it repeats: not at every look, forever."""
    from weightstore.sync import _follow

    looks = []

    def broken(source):
        looks.append(1)
        raise RuntimeError("a bug in the look")

    model = small_model()
    ws.publish(tmp_path, step_weights(model, 1), step=1)
    with Follower(model, tmp_path, poll=0.005, max_poll=0.005) as follower:
        assert follower.wait(1, timeout=30).step == 1
        with caplog.at_level("WARNING", logger="weightstore"):
            monkeypatch.setattr(_follow, "read_latest", broken)
            wait_until(lambda: len(looks) >= 5, what="five looks at LATEST")
            assert isinstance(follower.error, RuntimeError)
    said = [record for record in caplog.records if "a bug in the look" in record.getMessage()]
    assert len(said) == 1 and said[0].exc_info is not None, [record.getMessage() for record in said]


def test_a_folder_made_anew_is_followed_back_down_by_follow_and_the_follower(tmp_path, caplog):
    """A run that starts over in a deleted folder publishes step 1 after a follower took step
    20: the pointer went back, and it names what the folder now serves. Both followers take it
    (with a warning), instead of waiting for a step above 20 that may never come."""
    import shutil

    model = small_model()
    folder = tmp_path / "run"
    ws.publish(folder, step_weights(model, 20), step=20)
    versions_seen = ws.follow(folder, poll=0.005, timeout=30)
    assert next(versions_seen).step == 20
    with Follower(model, folder, poll=0.005) as follower:
        assert follower.wait(20, timeout=30).step == 20
        shutil.rmtree(folder)
        ws.publish(folder, step_weights(model, 1), step=1)
        with caplog.at_level("WARNING", logger="weightstore.sync._follow"):
            again = next(versions_seen)
            assert again.step == 1 and ws.load(again)["out/bias"].tolist() == [1.0]
            wait_until(lambda: follower.version is not None and follower.version.step == 1,
                       what="the follower to take the new run's step 1")
        assert tf2.export(model)["out/bias"].tolist() == [1.0]
    assert "LATEST went back from step 20 to 1" in caplog.text
    versions_seen.close()


def test_a_snapshot_that_fails_never_reaches_fit_in_the_background_either(tmp_path):
    callback = PublishCallback(tmp_path, every_n_batches=2, include="no_such_scope")
    fit(small_model(), callback, epochs=1)  # returns: the export refuses the selection each time
    assert callback.failures >= 1 and isinstance(callback.last_error, ws.SelectionError)
    assert ws.latest(tmp_path) is None


def test_a_tf1_follower_passes_over_a_damaged_version_once_as_follow_does(tmp_path, caplog, monkeypatch):
    """A version whose file is damaged (its manifest member fails its zip CRC): the Follower of a
    TF1 graph opened it again at every look of a local folder, logging each time, where
    ``ws.follow`` passes it over once. It is passed over once, the graph keeps step 1's values
    and ops, the error names the file until step 3 is assigned."""
    from weightstore.sync import _follow

    looks = []
    counted = _follow.read_latest
    monkeypatch.setattr(_follow, "read_latest", lambda source: looks.append(1) or counted(source))
    v1 = tf.compat.v1
    with tf.Graph().as_default() as graph, v1.Session(graph=graph) as sess:
        weight = v1.get_variable("w", (2, 3), initializer=v1.zeros_initializer())
        graph.finalize()
        ops = len(graph.get_operations())
        ws.publish(tmp_path, {"w": np.full((2, 3), 1.0, np.float32)}, step=1)
        with Follower(sess, tmp_path, poll=0.005, max_poll=0.005) as follower:
            assert follower.wait(1, timeout=30).step == 1
            with caplog.at_level("WARNING", logger="weightstore"):
                side = ws.publish(tmp_path / "side", {"w": np.full((2, 3), 2.0, np.float32)}, step=2)
                data = bytearray((tmp_path / "side" / os.path.basename(side.path)).read_bytes())
                data[len(data) // 2] ^= 0xFF
                damaged = str(tmp_path / os.path.basename(side.path))
                (tmp_path / os.path.basename(side.path)).write_bytes(bytes(data))
                os.replace(tmp_path / "side" / "LATEST", tmp_path / "LATEST")  # damaged before LATEST names it
                wait_until(lambda: follower.error is not None, what="the follower seeing the damage")
                seen = len(looks)
                wait_until(lambda: len(looks) >= seen + 5, what="five more looks at LATEST")
                assert isinstance(follower.error, ws.FormatError) and follower.error.path == damaged
                assert sess.run(weight).tolist() == [[1.0] * 3] * 2
            assert caplog.text.count(damaged) == 1, caplog.text
            ws.publish(tmp_path, {"w": np.full((2, 3), 3.0, np.float32)}, step=3)
            assert follower.wait(3, timeout=30).step == 3 and follower.error is None
            assert sess.run(weight).tolist() == [[3.0] * 3] * 2
        assert len(graph.get_operations()) == ops
