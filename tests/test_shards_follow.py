"""Followers of sharded versions read only what changed: each block's BLAKE3 digest (in its
member's block table) decides, never its CRC-32. Four ranks publish each step (to the loopback S3 server, which
counts the bytes a follower fetches, or into a local folder)."""

from __future__ import annotations

import dataclasses
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

import weightstore as ws
from weightstore.formats._sharded_index import ShardIndex, TensorEntry

BUCKET = "weightstore-shards-follow"

#: the model of each step, as the writer processes and the test build it: step 2 changes
#: ``bias`` and ten rows of ``big``; step 3 changes ``small`` to bytes with the same CRC-32
MODEL = textwrap.dedent("""
    import numpy as np
    import weightstore as ws
    from crc_forge import forge_crc32_collision

    def model(step):
        rng = np.random.default_rng(23)
        m = {"big": rng.standard_normal((512, 1024)).astype(np.float32),
             "bias": rng.standard_normal(1024).astype(np.float32),
             "emb": rng.standard_normal((64, 256)).astype(np.float32),
             "small": rng.standard_normal((16, 16)).astype(np.float32)}
        if step >= 2:
            m["bias"] += 1
            m["big"][:10] += 1
        if step >= 3:
            m["small"] = forge_crc32_collision(m["small"], 5.0)
        return m

    def pieces_of(step, rank):
        m = model(step)
        held = {"big": ws.Piece(m["big"][rank * 128:(rank + 1) * 128], (rank * 128, 0), (512, 1024))}
        held |= {key: m[key] for key in [["bias"], ["emb"], ["small"], []][rank]}
        return held
""")
namespace: dict = {}
exec(MODEL, namespace)  # noqa: S102 - the same model text the writer processes run
model = namespace["model"]
pieces_of = namespace["pieces_of"]

def publish(folder, step):
    """The four ranks' shares, published here one after another, then the commit (writers in
    processes of their own are test_shards.py's and test_shards_kills.py's; a follower reads
    what they wrote alike)."""
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(step, rank), step=step, rank=rank, world=4, attempt=0)
    return ws.commit_shards(folder, step=step, world=4, attempt=0, timeout=30)


def member_bytes(server):
    """Bytes of members (not done-records or indexes) the server sent since its last reset."""
    return sum(r.sent for r in server.requests if r.method == "GET" and "rank-" in r.path
               and r.path.endswith(".safetensors"))


def partitioned_session():
    """A TF1 session holding the model's variables, ``big`` partitioned 3 ways (the writers
    held it 4 ways), so its assign reads regions."""
    tf = pytest.importorskip("tensorflow")
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        v1.get_variable("big", [512, 1024], partitioner=v1.fixed_size_partitioner(3, axis=0))
        for key, shape in (("bias", [1024]), ("emb", [64, 256]), ("small", [16, 16])):
            v1.get_variable(key, shape)
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    graph.finalize()
    return sess


def test_a_tf1_follower_fetches_only_the_parts_whose_blocks_changed(s3):
    pytest.importorskip("tensorflow")

    from weightstore.adapters import tf1
    from weightstore.adapters.serving.follower import Follower

    sess = partitioned_session()
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    indexes = {}

    with Follower(sess, folder, poll=0.5) as follower:
        for step in (1, 2, 3):
            s3.reset()
            version = publish(folder, step)
            assert follower.wait(step=step, timeout=60).step == step
            fetched = member_bytes(s3)
            exported = tf1.export(sess)
            for key, value in model(step).items():  # bit for bit the step's model
                assert exported[key].tobytes() == value.tobytes(), (step, key)
            with ws.open(version) as store:
                indexes[step] = store._reader.placed("small")
            report = follower.report
            if step == 1:  # everything; each part of big fetches whole blocks (64 rows) at its edges
                whole = sum(v.nbytes for v in model(1).values())
                assert whole <= fetched <= whole + 4 * 32 * 1024 * 4
            elif step == 2:  # bias, and the one part of big (rows 0-170) that holds rows 0-9
                assert sorted(report.assigned) == ["bias", "big"] and sorted(report.skipped) == ["emb", "small"]
                part = 171 * 1024 * 4 + 1024 * 4
                assert part <= fetched <= 1.2 * part, fetched / part
            else:  # a CRC-32 collision is a change: fetched, never skipped
                assert report.assigned == ["small"] and fetched == 16 * 16 * 4
    before, after = (indexes[step][0] for step in (2, 3))
    assert before.crcs == after.crcs and before.blocks != after.blocks


@pytest.fixture(scope="module")
def torch_versions(tmp_path_factory):
    """Steps 1 and 2 published by four ranks each into a local folder, and copies of
    both indexes with their block digests removed, as an index written before they existed."""
    folder = tmp_path_factory.mktemp("run")
    versions = [publish(folder, step) for step in (1, 2)]
    bare = []
    for version in versions:
        with ws.open(version) as store:  # as version 1 wrote it: block CRC-32s in the index, no digests
            index = store._reader.index
            tensors = {key: TensorEntry(entry.dtype, entry.shape, tuple(
                dataclasses.replace(piece, blocks=None) for piece in store._reader.placed(key)))
                for key, entry in index.tensors.items()}
        old = ShardIndex(index.step, index.attempt, index.world, index.created, index.members, tensors,
                         index.metadata, index.producer, version=1)
        path = Path(version.path).with_name(f"bare-{version.step}.wsindex")
        path.write_bytes(old.to_json())
        bare.append(str(path))
    return versions, bare


def test_a_torch_module_skips_unchanged_tensors_and_reloads_everything_without_digests(torch_versions):
    torch = pytest.importorskip("torch")
    from weightstore.adapters import torch as torch_adapter

    versions, bare = torch_versions
    module = torch.nn.ParameterDict({key: torch.nn.Parameter(torch.zeros(value.shape))
                                     for key, value in model(1).items()})
    assert sorted(torch_adapter.assign(module, versions[0]).assigned) == sorted(model(1))
    report = torch_adapter.assign(module, versions[1])
    assert sorted(report.assigned) == ["bias", "big"] and sorted(report.skipped) == ["emb", "small"]
    for key, value in model(2).items():
        assert module[key].detach().numpy().tobytes() == value.tobytes(), key
    with ws.open(bare[1]) as store:  # an index without block digests reads, but says nothing is unchanged
        assert store.info("emb").digest is None and store["big"].tobytes() == model(2)["big"].tobytes()
    for path in bare:  # so every tensor is read again, both times
        report = torch_adapter.assign(module, path, skip_unchanged=True)
        assert sorted(report.assigned) == sorted(model(2)) and not report.skipped


def test_a_follower_keeps_a_torch_module_at_the_latest_sharded_version(torch_versions):
    torch = pytest.importorskip("torch")
    from weightstore.adapters.serving.follower import Follower

    versions, _ = torch_versions
    module = torch.nn.ParameterDict({key: torch.nn.Parameter(torch.zeros(value.shape))
                                     for key, value in model(2).items()})
    with Follower(module, Path(versions[1].path).parent, poll=0.05) as follower:
        assert follower.wait(timeout=60).step == 2
    assert sorted(follower.report.assigned) == sorted(model(2))
    for key, value in model(2).items():
        assert module[key].detach().numpy().tobytes() == value.tobytes(), key


def test_a_tf2_follower_skips_the_tensors_whose_blocks_did_not_change(torch_versions):
    tf = pytest.importorskip("tensorflow")
    from weightstore.adapters import tf2
    from weightstore.adapters.serving.follower import Follower

    versions, _ = torch_versions
    variables = {key: tf.Variable(tf.zeros(value.shape)) for key, value in model(1).items()}
    assert sorted(tf2.assign(variables, versions[0]).assigned) == sorted(model(1))
    with Follower(variables, Path(versions[1].path).parent, after=1, poll=0.05) as follower:
        assert follower.wait(timeout=60).step == 2
    assert sorted(follower.report.assigned) == ["bias", "big"] and sorted(follower.report.skipped) == ["emb", "small"]
    for key, value in model(2).items():
        assert variables[key].numpy().tobytes() == value.tobytes(), key


@pytest.mark.parametrize("framework", ["tf1", "torch"])
def test_serving_goes_on_while_a_follower_fetches_a_sharded_version(tmp_path, monkeypatch, framework):
    """Every fetch of the second version (regions of a partitioned TF1 variable, whole tensors of
    a torch module) lets a ``reading()`` block opened meanwhile by another thread run to its end
    before the fetch does: the follower holds no lock while it reads the network or the disk."""
    from weightstore.adapters.serving.follower import Follower
    from weightstore.formats.sharded import ShardedReader

    if framework == "tf1":
        from weightstore.adapters import tf1

        target = partitioned_session()
        exported = lambda: tf1.export(target)  # noqa: E731
    else:
        torch = pytest.importorskip("torch")
        target = torch.nn.ParameterDict({key: torch.nn.Parameter(torch.zeros(value.shape))
                                         for key, value in model(1).items()})
        exported = lambda: {key: value.detach().numpy() for key, value in target.items()}  # noqa: E731
    folder = tmp_path / "run"
    publish(folder, 1)
    served: list[bool] = []  # per fetch of step 2: whether a reading() block ran to its end meanwhile
    armed = threading.Event()
    fetch = ShardedReader._read_region

    def fetching(reader, key, region, *, verify):
        if armed.is_set() and threading.current_thread().name.startswith("weightstore-follower"):
            done = threading.Event()

            def serve():
                with follower.reading():
                    pass
                done.set()

            threading.Thread(target=serve, daemon=True).start()
            served.append(done.wait(timeout=30))  # not a timing: a lock held would keep it out until the swap
        return fetch(reader, key, region, verify=verify)

    monkeypatch.setattr(ShardedReader, "_read_region", fetching)
    with Follower(target, folder, poll=0.05) as follower:
        assert follower.wait(step=1, timeout=60).step == 1
        armed.set()
        publish(folder, 2)
        assert follower.wait(step=2, timeout=120).step == 2
    assert sorted(follower.report.assigned) == ["bias", "big"] and sorted(follower.report.skipped) == ["emb", "small"]
    assert served and all(served), served
    for key, value in model(2).items():
        assert exported()[key].tobytes() == value.tobytes(), key
