"""tf2.publish_sharded: every worker of a MultiWorkerMirroredStrategy cluster writes its share of one version."""

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

import weightstore as ws
from weightstore.formats._sharded_index import BLOCK_BYTES

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from processes import fork_together, free_port  # noqa: E402

from weightstore.adapters import tf2  # noqa: E402
from weightstore.adapters._tf2_sharded import Segment, plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: the model every worker and the test build alike (the dense kernels are cut between rows)
MODEL = textwrap.dedent("""
    import keras
    import numpy as np

    def build(seed=23):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((32,)), keras.layers.Dense(512, activation="relu", name="hidden"),
                                 keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(256, name="wide"),
                                 keras.layers.Dense(4, name="out")])

    def data():
        rng = np.random.default_rng(5)
        return rng.standard_normal((16, 32)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
""")
namespace: dict = {}
exec(MODEL, namespace)  # noqa: S102 - the same model text the workers run
build, data = namespace["build"], namespace["data"]

#: one worker: a few steps of a custom training loop (Keras 3's fit is broken under this
#: strategy upstream, keras#20585), a sharded publish of step 1 from a background thread while
#: the main thread all-reduces, a publish of step 2 the chief fails, and its retry, which rank 1
#: does not live through (SIGKILLed as it starts writing)
WORKER = MODEL + textwrap.dedent("""
    import json, os, sys, threading, time
    import tensorflow as tf
    import weightstore as ws
    from weightstore.sync import _stages as stages
    from weightstore.adapters import tf2, _tf2_sharded

    folder, out = sys.argv[1], sys.argv[2]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(0.05)
    x, y = data()

    @tf.function
    def train_step():
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        strategy.run(step)

    for _ in range(3):
        train_step()
    published = []  # from a background thread, while the main thread runs collectives
    publisher = threading.Thread(target=lambda: published.append(
        tf2.publish_sharded(folder, model, step=1, strategy=strategy, timeout=60, metadata={"loss": 0.5})))
    publisher.start()
    count = tf.function(lambda: tf.constant(1.0))
    sums = [float(strategy.reduce("SUM", strategy.run(count), axis=None)) for _ in range(5)]
    publisher.join()
    assert sums == [2.0] * 5, sums
    version = published[0]
    ws.save(f"{out}/weights-{rank}.safetensors", {**tf2.export(model), "predictions": model(x).numpy()})
    result = {"path": version.path, "step": version.step, "metadata": version.metadata}

    more, said = f"{out}/more", {}  # calls that must fail alike everywhere, in a folder of their own

    def attempt(name, call):
        started = time.monotonic()
        try:
            said[name] = {"step": call().step}
        except ws.WeightStoreError as exc:
            said[name] = {"type": type(exc).__name__, "message": str(exc)}
        said[name]["seconds"] = time.monotonic() - started

    def disk_full(name):
        if name == "member-temporary":
            raise ws.StorageError("injected: disk full")
    stages.hook = disk_full if rank == 1 else stages.hook
    attempt("write fails", lambda: tf2.publish_sharded(more, model, step=1, strategy=strategy, timeout=30))
    stages.hook = lambda name: None
    left_out = {"exclude": "out/bias"} if rank == 1 else {}
    attempt("keys differ", lambda: tf2.publish_sharded(more, model, step=2, strategy=strategy, timeout=30, **left_out))
    other = {"w": tf.Variable(np.zeros(9 if rank == 1 else 8, np.float32))}  # rank 1 writes it in either plan
    attempt("shapes differ", lambda: tf2.publish_sharded(more, other, step=3, strategy=strategy, timeout=30))
    _tf2_sharded._NEWS_GRACE = 0.5
    if rank == 1:  # a call the chief never makes times out, and must not shift the calls after it
        attempt("alone", lambda: tf2.publish_sharded(more, model, step=4, strategy=strategy, timeout=0.5))
    strategy.reduce("SUM", strategy.run(count), axis=None)
    _tf2_sharded._NEWS_GRACE = 8.0
    if rank == 0:  # the chief comes 3 s late: 2 s past the worker's timeout, within the grace
        time.sleep(3)
    attempt("after a call alone", lambda: tf2.publish_sharded(more, model, step=4, strategy=strategy,
                                                              timeout=30 if rank == 0 else 1))
    reads = _tf2_sharded._read

    def unreadable(sources, share):
        raise ws.StorageError("injected: unreadable")
    _tf2_sharded._read = unreadable if rank == 1 else reads  # read at the call, before the chief is heard
    attempt("read fails", lambda: tf2.publish_sharded(more, model, step=5, strategy=strategy, timeout=30))
    _tf2_sharded._read = reads
    attempt("background", lambda: tf2.publish_sharded(more, model, step=6, strategy=strategy, timeout=30,
                                                       background=True).result())
    if rank == 0:  # which of the calls' keys the chief's commits left in the coordination service
        import hashlib
        from concurrent.futures import ThreadPoolExecutor
        from tensorflow.python.eager import context
        from weightstore.io.folders import folder_for

        def kept(where, step, call, what):
            digest = hashlib.sha256(folder_for(where).where.encode()).hexdigest()[:16]
            try:
                # a present key answers at once; 250 ms leaves a busy machine's round trip time
                # (1 ms did not: a kept key read as deleted), and bounds the wait on each absent one
                context.context().get_config_key_value(f"weightstore/{digest}/step-{step}/call-{call}/{what}", 250)
                return True
            except tf.errors.OpError:
                return False
        looks = [(more, step, what) for step in range(1, 7) for what in ("attempt", "gave-up", "committed")]
        looks += [(folder, 1, what) for what in ("attempt", "committed")]
        with ThreadPoolExecutor(len(looks)) as pool:  # at once: each absent key waits its 250 ms
            found = list(pool.map(lambda look: kept(look[0], look[1], 0, look[2]), looks))
        said["kept"] = [[step, what] for (_, step, what), there in zip(looks, found) if there]
    with open(f"{out}/more-{rank}.json", "w") as handle:
        json.dump(said, handle)

    # deltas: steps 2 and 3 move one element on each side of the plan's cut, alike on every worker;
    # rank 0 keeps a copy of its share, rank 1 reads its member back
    kernel, planner = model.get_layer("wide").kernel, ws.Delta() if rank == 0 else True
    for step in (1, 2, 3):
        if step > 1:
            moved = kernel.numpy()
            moved[[3, 500], [7, 200]] += step
            kernel.assign(moved)
        tf2.publish_sharded(f"{out}/deltas", model, step=step, strategy=strategy, timeout=60, delta=planner)
        if rank == 0:
            ws.save(f"{out}/deltas-{step}.safetensors", tf2.export(model))

    def outage(name):
        if name == "done-written":
            raise ws.StorageError("injected outage")
    stages.hook = outage if rank == 0 else stages.hook  # the chief fails after writing its own member
    try:
        tf2.publish_sharded(folder, model, step=2, strategy=strategy, timeout=60)
    except ws.WeightStoreError as exc:
        with open(f"{out}/failed-{rank}.json", "w") as handle:
            json.dump({"type": type(exc).__name__, "message": str(exc)}, handle)
    stages.hook = lambda name: None
    if rank == 1:
        stages.hook = lambda name: os.kill(os.getpid(), 9) if name == "member-temporary" else None
    try:
        tf2.publish_sharded(folder, model, step=2, strategy=strategy, timeout=3)
    except ws.ShardTimeoutError as exc:
        result["timeout"] = {"missing": exc.missing, "message": str(exc)}
    with open(f"{out}/result-{rank}.json", "w") as handle:
        json.dump(result, handle)
    os._exit(0)  # not TF's shutdown barrier, which would wait for the killed worker
""")


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    """Two workers on 127.0.0.1, each its own process with its own TF_CONFIG, run once for the
    module's tests (``./tasks test`` gives a file's tests to one worker): forked from one
    interpreter that imported TensorFlow and Keras (``processes.fork_together``), which reads
    TF_CONFIG only when a worker makes its strategy."""
    tmp = tmp_path_factory.mktemp("mwms")
    folder, out = tmp / "run", tmp / "out"
    out.mkdir()
    workers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    envs = [{**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2",
             "TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})}
            for index in range(2)]
    chief, worker = fork_together("import numpy, tensorflow, keras, weightstore", WORKER, [[str(folder), str(out)]] * 2,
                                  envs, timeout=240)
    assert chief.returncode == 0, chief.stderr[-3000:]
    assert worker.returncode == -9, worker.stderr[-3000:]  # it killed itself, as planned
    return folder, out


@pytest.mark.slow
def test_two_workers_each_write_their_share_and_the_version_restores_into_a_plain_model(cluster_run):
    folder, out = cluster_run
    chief = json.loads((out / "result-0.json").read_text())
    assert chief["step"] == 1 and chief["metadata"] == {"loss": 0.5}
    with ws.open(out / "weights-0.safetensors") as worker_0, ws.open(out / "weights-1.safetensors") as worker_1:
        trained = {key: worker_0[key] for key in worker_0}
        assert all(worker_1[key].tobytes() == value.tobytes() for key, value in trained.items())  # mirrored
    predictions = trained.pop("predictions")
    with ws.open(chief["path"]) as store:
        tensors = store._reader.index.tensors
    held = [0, 0]
    for key, entry in tensors.items():
        for box in entry.layout.boxes_in([(0, n) for n in entry.shape]):
            held[box.member] += int(np.prod(box.shape)) * trained[key].itemsize
    assert sum(held) == sum(value.nbytes for value in trained.values())
    assert all(0.25 <= share / sum(held) <= 0.75 for share in held), held
    assert len(tensors["hidden/kernel"].layout) + len(tensors["wide/kernel"].layout) > 2
    version = ws.latest(folder)
    assert version.path == chief["path"]
    loaded = ws.load(version)
    assert sorted(loaded) == sorted(trained)
    assert all(loaded[key].tobytes() == value.tobytes() for key, value in trained.items())
    plain = build(seed=7)  # another initialization: only the assign makes it the trained model
    report = tf2.assign(plain, version)
    assert sorted(report.assigned) == sorted(trained)
    np.testing.assert_array_equal(plain(data()[0]).numpy(), predictions)


@pytest.mark.slow
def test_a_worker_killed_before_writing_times_out_on_the_chief_and_latest_stays(cluster_run):
    folder, out = cluster_run
    chief = json.loads((out / "result-0.json").read_text())
    assert chief["timeout"]["missing"] == [1], chief
    assert "rank 1 of 2 did not finish within" in chief["timeout"]["message"]
    assert ws.latest(folder).step == 1
    assert not (folder / "step-000000000002.wsindex").exists()
    assert not (out / "result-1.json").exists()  # rank 1 never got past its write
    assert "step-000000000002.attempt-1: rank 1 of 2" in chief["timeout"]["message"]  # the retry's own attempt


@pytest.mark.slow
def test_a_chief_that_fails_tells_the_workers_and_nothing_is_published(cluster_run):
    folder, out = cluster_run
    assert json.loads((out / "failed-0.json").read_text()) == {"type": "StorageError", "message": "injected outage"}
    heard = json.loads((out / "failed-1.json").read_text())
    assert heard["type"] == "PublishError" and heard["message"].endswith("the chief: injected outage"), heard
    assert not (folder / "step-000000000002.wsindex").exists() and ws.latest(folder).step == 1


@pytest.mark.slow
def test_a_worker_whose_write_fails_tells_the_chief_which_stops_at_once_saying_why(cluster_run):
    _, out = cluster_run
    chief, worker = (json.loads((out / f"more-{rank}.json").read_text())["write fails"] for rank in range(2))
    assert (worker["type"], worker["message"]) == ("StorageError", "injected: disk full")
    assert chief["type"] == "PublishError", chief
    assert chief["message"].endswith("rank 1 of 2 gave up: StorageError: injected: disk full; nothing was published")
    assert chief["seconds"] < 15, chief  # not its timeout of 30 s
    assert not (out / "more" / "step-000000000001.wsindex").exists()


@pytest.mark.slow
def test_a_worker_whose_read_fails_tells_the_chief_too(cluster_run):
    _, out = cluster_run
    chief, worker = (json.loads((out / f"more-{rank}.json").read_text())["read fails"] for rank in range(2))
    assert (worker["type"], worker["message"]) == ("StorageError", "injected: unreadable")
    assert chief["message"].endswith("rank 1 of 2 gave up: StorageError: injected: unreadable; nothing was published")
    assert chief["seconds"] < 15, chief  # not its timeout of 30 s


@pytest.mark.slow
def test_workers_that_would_publish_other_keys_or_shapes_than_the_chief_commit_nothing(cluster_run):
    _, out = cluster_run
    said = [json.loads((out / f"more-{rank}.json").read_text()) for rank in range(2)]
    for call, difference in [("keys differ", "'out/bias' (float32 [4]) is in the chief's, not in rank 1's"),
                             ("shapes differ", "'w' is float32 [8] in the chief's, float32 [9] in rank 1's")]:
        for rank in range(2):
            assert said[rank][call]["type"] == "PublishError", (rank, said[rank][call])
            assert "rank 1 of 2 gave up: its plan differs from the chief's" in said[rank][call]["message"]
            assert difference in said[rank][call]["message"], (rank, said[rank][call])
    assert not any((out / "more" / f"step-00000000000{step}.wsindex").exists() for step in (2, 3))


@pytest.mark.slow
def test_a_worker_call_the_chief_never_made_does_not_shift_the_next_and_a_late_chief_is_waited_for(cluster_run):
    _, out = cluster_run
    said = [json.loads((out / f"more-{rank}.json").read_text()) for rank in range(2)]
    assert said[0]["after a call alone"]["step"] == said[1]["after a call alone"]["step"] == 4, said
    # the chief deleted every key no worker reads again: of each folder, only its last commit's news
    # stays (a commit to one folder leaves another's, whose workers may not have read it yet)
    assert said[0]["kept"] == [[6, "committed"], [1, "committed"]]
    assert said[1]["alone"]["type"] == "ShardTimeoutError" and said[1]["alone"]["seconds"] < 5, said[1]["alone"]
    assert "no word of the attempt from the chief (rank 0) within 1s" in said[1]["alone"]["message"]
    assert said[1]["after a call alone"]["seconds"] > 1  # it waited past its timeout (1 s) for the chief
    assert (out / "more" / "step-000000000004.wsindex").exists()


@pytest.mark.slow
def test_each_worker_writes_its_member_as_a_delta_of_its_own_and_the_versions_read_bit_exact(cluster_run):
    from weightstore import sync as versions

    _, out = cluster_run
    listed = versions.list_versions(out / "deltas")
    assert [(e.step, e.kind) for e in listed] == [(1, "sharded"), (2, "sharded-delta"), (3, "sharded-delta")]
    for entry in listed:
        with ws.open(out / f"deltas-{entry.step}.safetensors") as store:
            want = {key: store[key] for key in store}
        loaded = ws.load(entry.path)
        assert sorted(loaded) == sorted(want)
        assert all(loaded[key].tobytes() == value.tobytes() for key, value in want.items()), entry.step
        suffix = ".safetensors" if entry.step == 1 else ".wsdelta"
        assert sorted(p.name for p in (out / "deltas" / f"step-{entry.step:012d}.attempt-0").glob(f"rank-*{suffix}")) \
            == [f"rank-0000{rank}{suffix}" for rank in range(2)]
    assert all(entry.member_bytes < listed[0].member_bytes / 20 for entry in listed[1:]), listed


@pytest.mark.slow
def test_a_background_publish_gives_every_worker_the_version_and_the_chief_s_incarnation(cluster_run):
    _, out = cluster_run
    said = [json.loads((out / f"more-{rank}.json").read_text())["background"] for rank in range(2)]
    assert said[0]["step"] == said[1]["step"] == 6, said
    assert ws.latest(out / "more").step == 6
    from weightstore.formats._sharded_index import parse_done

    attempt = out / "more" / "step-000000000006.attempt-0"
    drawn = {parse_done((attempt / f"rank-0000{rank}.done").read_bytes()).incarnation for rank in range(2)}
    assert len(drawn) == 1 and drawn.pop()


def test_the_plan_splits_the_bytes_evenly_and_covers_every_row_once():
    shapes = [(1000, 300), (7,), (), (0, 5), (300, 2048), (5, 3), (64, 64, 3), (1, 200_000)]
    segments = [Segment(f"t{i}", shape, 4, (0,) * len(shape), shape) for i, shape in enumerate(shapes)]
    total = sum(segment.nbytes for segment in segments)
    largest = max(s.row_bytes if s.nbytes >= BLOCK_BYTES else s.nbytes for s in segments if s.shape)
    assert largest == 800_000  # the (1, 200000) tensor's one row
    for world in (1, 2, 3, 4, 7):
        shares = plan(segments, world)
        assert shares == plan(list(segments), world)  # every worker computes the same plan
        rows: dict[str, list[tuple[int, int]]] = {}
        for share in shares:
            for segment, first, end in share:
                rows.setdefault(segment.key, []).append((first, end))
        for segment in segments:
            spans = sorted(rows[segment.key])
            assert spans[0][0] == 0 and spans[-1][1] == (segment.shape[0] if segment.shape else 1)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), spans  # no gap, no overlap
        held = [sum((end - first) * (segment.row_bytes if segment.shape else 4) for segment, first, end in share)
                for share in shares]
        assert sum(held) == total
        # off its share by at most what cannot be cut: a row, or a tensor under one block
        assert max(abs(h - total / world) for h in held) <= largest, (world, held)


class Holder(tf.Module):
    def __init__(self, base):
        super().__init__()
        self.table = tf.__internal__.distribute.ShardedVariable(
            [tf.Variable(np.arange(12.0).reshape(3, 4) + base), tf.Variable(np.arange(8.0).reshape(2, 4) - base)])
        self.scale = tf.Variable(np.float32(base))


def test_a_sharded_variable_is_written_shard_by_shard_in_one_process(tmp_path):
    written = Holder(100)
    version = tf2.publish_sharded(tmp_path / "run", written, step=1, strategy=tf.distribute.get_strategy())
    with ws.open(version) as store:
        table = store._reader.index.tensors["table"]
    assert [box.start for box in table.layout.boxes_in([(0, 5), (0, 4)])] == [(0, 0), (3, 0)]  # never joined
    assert ws.load(version)["table"].tobytes() == tf2.export(written)["table"].tobytes()
    restored = Holder(0)
    tf2.assign(restored, version)
    assert tf2.export(restored)["table"].tobytes() == tf2.export(written)["table"].tobytes()
    assert float(restored.scale.numpy()) == 100.0
    # a retry of the step after a dead try gets the next attempt; steps still go forward
    with pytest.raises(ws.PublishError, match="not after step 1"):
        tf2.publish_sharded(tmp_path / "run", written, step=1, strategy=tf.distribute.get_strategy())
    (tmp_path / "run" / "step-000000000002.attempt-0").mkdir()
    assert ws.shards.next_attempt(tmp_path / "run", 2) == 1
    version = tf2.publish_sharded(tmp_path / "run", written, step=2, strategy=tf.distribute.get_strategy(),
                                  include="table")
    assert json.loads(Path(version.path).read_text())["attempt"] == 1 and sorted(ws.load(version)) == ["table"]
    version = tf2.publish_sharded(tmp_path / "run", written, step=3, strategy=tf.distribute.get_strategy(),
                                  digests=False)  # a checkpoint no follower reads: no digest per block
    with ws.open(version) as store:
        assert store.region_digest("table", ()) is None
    assert ws.load(version)["table"].tobytes() == tf2.export(written)["table"].tobytes()


def test_export_pieces_publish_with_publish_shard_and_read_back_as_export(tmp_path):
    """Alone, a ShardedVariable comes shard by shard and the rest whole; two workers' shares
    (the plan publish_sharded cuts) tile the model, and the version predicts as the model does."""
    written = Holder(100)
    pieces = tf2.export_pieces(written)
    assert {key: [piece.start for piece in found] for key, found in pieces.items()} == {
        "table": [(0, 0), (3, 0)], "scale": [()]}
    ws.publish_shard(tmp_path / "alone", pieces, step=1, rank=0, world=1, attempt=0)
    version = ws.commit_shards(tmp_path / "alone", step=1, world=1, attempt=0, timeout=10)
    assert {key: value.tobytes() for key, value in ws.load(version).items()} == {
        key: value.tobytes() for key, value in tf2.export(written).items()}

    with tf.distribute.MirroredStrategy().scope():
        mirrored = tf.Variable(np.arange(6.0).reshape(2, 3))
    ((piece,),) = tf2.export_pieces({"m": mirrored}).values()  # this replica's value, whole
    assert piece.start == (0, 0) and piece.array.tobytes() == np.arange(6.0).reshape(2, 3).tobytes()

    model = build()
    shares = [tf2.export_pieces(model, rank=rank, world=2) for rank in (0, 1)]
    (first,), (second,) = shares[0]["wide/kernel"], shares[1]["wide/kernel"]  # cut between rows, read from the replica
    assert first.start == (0, 0) and second.start == (first.array.shape[0], 0) and 0 < second.start[0] < 512
    for rank, share in enumerate(shares):
        ws.publish_shard(tmp_path / "two", share, step=1, rank=rank, world=2, attempt=0)
    version = ws.commit_shards(tmp_path / "two", step=1, world=2, attempt=0, timeout=10)
    exported = tf2.export(model)
    assert {key: value.tobytes() for key, value in ws.load(version).items()} == {
        key: value.tobytes() for key, value in exported.items()}
    served = build(seed=5)
    tf2.assign(served, version)
    x, _ = data()
    np.testing.assert_array_equal(served(x, training=False).numpy(), model(x, training=False).numpy())
    with pytest.raises(ValueError, match="rank 2 is not one of world 2's ranks"):
        tf2.export_pieces(model, rank=2, world=2)


def test_variables_under_words_key_what_export_reads():
    model = build()
    assert list(tf2.variables(model)) == tf2.keys(model) == list(tf2.export(model))
    assert tf2.variables(model)["hidden/kernel"] is model.get_layer("hidden").kernel
    assert sorted(tf2.variables(model, scope="bn", trainable_only=True)) == ["beta", "gamma"]
    assert sorted(tf2.variables(model, include="*/kernel")) == sorted(tf2.export(model, include="*/kernel"))
    assert tf2.variables(keras.Sequential([keras.layers.Dense(2)])) == {}  # not built: nothing yet, no error


def test_what_would_need_a_collective_or_is_not_json_is_refused_before_anything_is_written(tmp_path):
    total = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM)
    with pytest.raises(ws.WeightStoreError, match="'total' is synchronized on read.*exclude="):
        tf2.publish_sharded(tmp_path / "run", {"total": total}, step=1, strategy=tf.distribute.get_strategy())
    with pytest.raises(TypeError, match="metadata must be JSON-serializable"):
        tf2.publish_sharded(tmp_path / "run", {"w": tf.Variable(1.0)}, step=1, strategy=tf.distribute.get_strategy(),
                            metadata={"when": object()})
    with pytest.raises(TypeError, match="delta must be True, False or a ws.Delta, not str"):
        tf2.publish_sharded(tmp_path / "run", {"w": tf.Variable(1.0)}, step=1, strategy=tf.distribute.get_strategy(),
                            delta="yes")
    assert not (tmp_path / "run").exists()
