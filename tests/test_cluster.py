"""Rank, world and attempt of a sharded version's writers, taken from the cluster the job runs."""

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
from processes import fork_together, free_port

import weightstore as ws
from weightstore.formats._sharded_index import parse_done
from weightstore.sharded import _cluster as cluster

ROOT = Path(__file__).resolve().parents[1]


def tf_config(task_type, index, *, chief=1, workers=2):
    return json.dumps({"cluster": {"chief": [f"127.0.0.1:{2000 + i}" for i in range(chief)],
                                   "worker": [f"127.0.0.1:{3000 + i}" for i in range(workers)],
                                   "ps": ["127.0.0.1:4000"], "evaluator": ["127.0.0.1:5000"]},
                       "task": {"type": task_type, "index": index}})


def rows_of(rank, world, tensor):
    """The rows rank ``rank`` of ``world`` writes, as a piece."""
    size = tensor.shape[0] // world
    return ws.Piece(tensor[rank * size:(rank + 1) * size], (rank * size, 0), tensor.shape)


def test_tf_config_ranks_the_chief_then_the_workers_and_a_version_commits(tmp_path, monkeypatch):
    kernel = np.arange(3 * 4 * 5, dtype=np.float32).reshape(12, 5)
    folder = tmp_path / "run"
    for task_type, index, rank in [("worker", 1, 2), ("chief", 0, 0), ("worker", 0, 1)]:
        monkeypatch.setenv("TF_CONFIG", tf_config(task_type, index))
        assert cluster.membership() == cluster.Membership(rank, 3, None, "TF_CONFIG")
        ws.publish_shard(folder, {"k": rows_of(rank, 3, kernel)}, step=1, attempt=4)  # rank and world from TF_CONFIG
    version = ws.commit_shards(folder, step=1, attempt=4, timeout=5)  # world from TF_CONFIG too
    assert ws.load(version)["k"].tobytes() == kernel.tobytes()
    members = sorted(p.name for p in (folder / "step-000000000001.attempt-4").glob("*.safetensors"))
    assert members == ["rank-00000.safetensors", "rank-00001.safetensors", "rank-00002.safetensors"]
    # with no chief, worker 0 is rank 0; "master" is an older launcher's chief
    monkeypatch.setenv("TF_CONFIG", tf_config("worker", 0, chief=0))
    assert (cluster.membership().rank, cluster.membership().world) == (0, 2)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"master": ["a:1"], "worker": ["b:1"]},
                                                "task": {"type": "worker", "index": 0}}))
    assert (cluster.membership().rank, cluster.membership().world) == (1, 2)


@pytest.mark.parametrize("config, message", [
    (tf_config("ps", 0), "task 'ps' 0 writes no member"),
    (tf_config("evaluator", 0), "task 'evaluator' 0 writes no member"),
    (tf_config("worker", 2), "task 'worker' 2 is not in the cluster, which has 2"),
    ("{not json", "TF_CONFIG is not a cluster and task"),
    (json.dumps({"cluster": {"worker": ["a:1"]}}), "TF_CONFIG is not a cluster and task"),
    (json.dumps({"cluster": ["a:1"], "task": {"type": "worker", "index": 0}}), "cluster is not a mapping"),
    (json.dumps({"cluster": {"worker": 3}, "task": {"type": "worker", "index": 0}}), "to a list of addresses"),
    (json.dumps({"cluster": {"worker": ["a", "b"]}, "task": {"type": "worker", "index": 1.7}}), "index 1.7 is no int"),
    # nested past what the stdlib parser, or repr() of what it parsed, can take: RecursionError leaked
    ("[" * 5000 + "]" * 5000, "TF_CONFIG is not a cluster and task .*more than 100 levels deep"),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": %s, "index": 0}}' % ("[" * 990 + "]" * 990),
     "TF_CONFIG is not a cluster and task .*more than 100 levels deep"),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": %s}}' % ("[" * 500 + "]" * 500),
     "TF_CONFIG is not a cluster and task .*more than 100 levels deep"),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": [1], "index": 0}}', "task type \\[1\\] is no string"),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": "\\u00b2"}}', "index '²' is no int"),
])
def test_a_bad_tf_config_is_refused_and_nothing_is_written(tmp_path, monkeypatch, config, message):
    monkeypatch.setenv("TF_CONFIG", config)
    with pytest.raises(ws.WeightStoreError, match=message):
        ws.publish_shard(tmp_path / "run", {"k": np.zeros(2)}, step=1, attempt=0)
    assert not (tmp_path / "run").exists()


def test_without_an_attempt_or_a_cluster_the_error_says_what_to_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config("chief", 0))
    with pytest.raises(ws.WeightStoreError, match="attempt was not given and TF_CONFIG has no store to agree one through"):
        ws.publish_shard(tmp_path / "run", {"k": np.zeros(2)}, step=1)
    with pytest.raises(ws.WeightStoreError, match="attempt was not given"):
        ws.commit_shards(tmp_path / "run", step=1, timeout=1)
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ws.WeightStoreError, match="nothing says them.*pass rank=, world= and attempt="):
        ws.publish_shard(tmp_path / "run", {"k": np.zeros(2)}, step=1, attempt=0)
    with pytest.raises(ws.WeightStoreError, match="attempt was not given and no job store agrees one; pass "
                                                  "attempt=") as caught:  # rank and world given: only the attempt
        ws.publish_shard(tmp_path / "run", {"k": np.zeros(2)}, step=1, rank=0, world=1)
    assert "rank and world were not given" not in str(caught.value)
    with pytest.raises(ws.WeightStoreError, match="attempt was not given and no job store"):
        ws.commit_shards(tmp_path / "run", step=1, world=1, timeout=1)
    ws.publish_shard(tmp_path / "run", {"k": np.zeros(2)}, step=1, rank=0, world=1, attempt=0)  # all given: no look
    assert ws.load(ws.commit_shards(tmp_path / "run", step=1, world=1, attempt=0, timeout=1))["k"].shape == (2,)
    assert not (tmp_path / "run" / "step-000000000001.attempt-1").exists()


#: one rank of two (forked from one interpreter that imported torch and jax) of a job that runs
#: twice, as a torch.distributed job, then (its process group destroyed, torch still imported)
#: as a jax.distributed one, in a folder each: joins the framework's cluster, writes its half of
#: "k"; rank 0 commits and prints each version's path
RANK = textwrap.dedent("""
    import os, sys
    import numpy as np
    import weightstore as ws
    kernel = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    for framework in ("torch", "jax"):
        folder = os.path.join(sys.argv[1], framework)
        if framework == "torch":
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method="env://")
        else:
            import jax
            jax.distributed.initialize(os.environ["COORDINATOR"], num_processes=2, process_id=int(os.environ["RANK"]))
        membership = ws.sharded.membership()
        assert membership.source == ("torch.distributed" if framework == "torch" else "jax.distributed"), membership
        rank = membership.rank
        for step in (5, 6):  # the attempt and the incarnation agreed through the job's store, never from its environment
            ws.publish_shard(folder, {"k": ws.Piece(kernel[rank * 4:rank * 4 + 4], (rank * 4, 0), (8, 3))}, step=step)
            if rank == 0:
                print(framework, ws.commit_shards(folder, step=step, timeout=60).path)
        if framework == "torch":
            dist.destroy_process_group()
        else:
            jax.distributed.shutdown()
""")


def test_a_torch_then_a_jax_cluster_give_rank_and_world_and_their_store_agrees_the_attempt(tmp_path):
    port, coordinator = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "COORDINATOR": f"127.0.0.1:{coordinator}", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "2",
           "JAX_PLATFORMS": "cpu"}
    env.pop("TF_CONFIG", None)
    ranks = fork_together("import numpy, weightstore, torch.distributed, jax", RANK, [[str(tmp_path)]] * 2,
                          [{**env, "RANK": str(rank)} for rank in range(2)], timeout=120)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr[-3000:] for rank in ranks]
    printed = ranks[0].stdout.split()
    assert [(framework, Path(path).name) for framework, path in zip(printed[::2], printed[1::2], strict=True)] == [
        ("torch", "step-000000000005.wsindex"), ("torch", "step-000000000006.wsindex"),
        ("jax", "step-000000000005.wsindex"), ("jax", "step-000000000006.wsindex")]
    for framework in ("torch", "jax"):
        folder = tmp_path / framework
        assert ws.latest(folder).step == 6
        assert ws.load(ws.latest(folder))["k"].tobytes() == np.arange(24, dtype=np.float32).tobytes()
        # TORCHELASTIC_RESTART_COUNT=2 is not the attempt: the store agreed 0, the folder's first
        attempt = folder / "step-000000000006.attempt-0"
        assert sorted(p.name for p in attempt.iterdir()) == [
            "claimed-by", "rank-00000.blocks", "rank-00000.done", "rank-00000.safetensors", "rank-00001.blocks",
            "rank-00001.done", "rank-00001.safetensors"], framework
        records = [parse_done((attempt / f"rank-0000{rank}.done").read_bytes()) for rank in range(2)]
        assert records[0].incarnation and records[0].incarnation == records[1].incarnation, framework
