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


def test_variables_key_what_export_reads_a_partitioned_one_as_its_parts():
    graph, sess = build(3, seed=1)
    with graph.as_default():
        step = v1.Variable(0, name="step", trainable=False)
    assert tf1.variables(sess)["step"] is step  # reads no value: one that holds none yet is listed too
    sess.run(step.initializer)
    found = tf1.variables(sess)
    assert sorted(found) == sorted(tf1.export(sess)) == ["net/bias", "net/emb", "net/kernel", "step"]
    parts = found["net/kernel"]
    assert [part.op.name for part in parts] == [f"net/kernel/part_{i}" for i in range(3)]
    assert sess.run(found["net/bias"]).tobytes() == tf1.export(sess)["net/bias"].tobytes()
    assert sorted(tf1.variables(sess, scope="net", trainable_only=True, exclude="emb")) == ["bias", "kernel"]
    with pytest.raises(ws.SelectionError, match="'nett'"):
        tf1.variables(sess, scope="nett")


BUCKET = "weightstore-shards-tf1"
#: 9.4 MiB in rows of 16 KiB: 150 rows a writer's part, 200 a reader's, so every reader's part
#: starts or ends inside a writer's part
ROWS, COLS = 600, 4096


def build_wide(parts: int, seed: int):
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(seed)
        v1.get_variable("wide", [ROWS, COLS], partitioner=v1.fixed_size_partitioner(parts, axis=0))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    return graph, sess


def fetched_rows(server, placed, member_of_path):
    """The global rows (first, last) of each ranged GET of a member, from its pieces as placed."""
    import re

    spans = []
    for request in server.requests:
        if request.method != "GET" or not request.path.endswith(".safetensors") or not request.range:
            continue
        first, last = map(int, re.match(r"bytes=(\d+)-(\d+)", request.range).groups())
        member = member_of_path(request.path)
        rows = []
        for at in (first, last):
            entry = next(p for p in placed
                         if p.member == member and p.offset <= at < p.offset + 4 * p.shape[0] * p.shape[1])
            rows.append(entry.start[0] + (at - entry.offset) // (4 * entry.shape[1]))
        spans.append(tuple(rows))
    return spans


def test_each_part_of_a_finalized_graph_reads_only_its_region_from_s3(server):
    import uuid

    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    _, writer = build_wide(4, seed=3)
    expected = tf1.export(writer)["wide"]
    for rank, piece in enumerate(tf1.export_pieces(writer)["wide"]):
        ws.publish_shard(folder, {"wide": [piece]}, step=1, rank=rank, world=4, attempt=0)
    version = ws.commit_shards(folder, step=1, world=4, attempt=0, timeout=30)
    with ws.open(version) as store:  # the pieces' strips where their members' block tables put them
        placed = store._reader.placed("wide")
    graph, reader = build_wide(3, seed=4)
    graph.finalize()
    server.reset()
    tf1.assign(reader, version)
    assert tf1.export(reader)["wide"].tobytes() == expected.tobytes()
    member_bytes = sum(r.sent for r in server.requests if r.path.endswith(".safetensors"))
    assert expected.nbytes <= member_bytes <= 1.1 * expected.nbytes
    rows_per_block = max(p.rows for p in placed)
    parts = [(lo - rows_per_block, hi + rows_per_block) for lo, hi in ((0, 200), (200, 400), (400, 600))]
    spans = fetched_rows(server, placed, lambda path: int(path.rsplit("rank-", 1)[1][:5]))
    assert spans
    for first, last in spans:  # each read lies within one part's region, widened by a block
        assert any(lo <= first and last < hi for lo, hi in parts), (first, last)
