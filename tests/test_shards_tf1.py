"""A TF1 graph partitioned 4 ways, published part by part by 4 ranks, restored 3 ways into a finalized graph."""

from __future__ import annotations

import pytest

tf = pytest.importorskip("tensorflow")

import weightstore as ws  # noqa: E402
from weightstore.adapters import tf1  # noqa: E402

v1 = tf.compat.v1


def build(parts: int, seed: int):
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(seed)
        v1.get_variable("net/kernel", [12, 5], partitioner=v1.fixed_size_partitioner(parts, axis=0))
        v1.get_variable("net/emb", [6, 8], partitioner=v1.fixed_size_partitioner(parts, axis=1))
        v1.get_variable("net/bias", [5], initializer=v1.random_normal_initializer())
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    return graph, sess


def test_partitioned_four_ways_restores_into_a_finalized_graph_partitioned_three_ways(tmp_path):
    _, writer = build(4, seed=1)
    expected = tf1.export(writer)
    pieces = tf1.export_pieces(writer)
    assert [len(pieces[k]) for k in ("net/kernel", "net/emb", "net/bias")] == [4, 4, 1]
    assert [p.start for p in pieces["net/emb"]] == [(0, 0), (0, 2), (0, 4), (0, 6)]
    for rank in range(4):  # each rank publishes the part it holds; rank 0 the plain variable too
        held = {key: [parts[rank]] for key, parts in pieces.items() if len(parts) == 4}
        if rank == 0:
            held["net/bias"] = pieces["net/bias"]
        ws.publish_shard(tmp_path, held, step=1, rank=rank, world=4, attempt=0)
    version = ws.commit_shards(tmp_path, step=1, world=4, attempt=0, timeout=10)
    graph, reader = build(3, seed=2)
    graph.finalize()  # assign adds no op
    report = tf1.assign(reader, ws.latest(tmp_path))
    assert sorted(report.assigned) == sorted(expected)
    restored = tf1.export(reader)
    for key, value in expected.items():
        assert restored[key].tobytes() == value.tobytes(), key
    assert sorted(tf1.assign(reader, version).skipped) == sorted(expected)  # hot reload: nothing changed
