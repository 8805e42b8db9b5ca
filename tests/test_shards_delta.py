"""Sharded delta versions: each rank writes its member as a delta of its own member of the version
before (no byte sent to another rank), every rank deciding alike when a full version is due; a
version with delta members reads like any other, and retention keeps the versions it builds on."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import weightstore as ws
from weightstore import sync as versions
from weightstore.formats._sharded_index import ShardIndex
from weightstore.io._writeback import behind

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "weightstore-shards-delta"

#: each step's model, as the writer processes and the test build it: 2% of ``w``'s bf16 elements
#: move one ulp a step, ``b`` stays
MODEL = textwrap.dedent("""
    import numpy as np, ml_dtypes
    import weightstore as ws

    def model(step):
        rng = np.random.default_rng(7)
        w = rng.standard_normal((64, 1024)).astype(ml_dtypes.bfloat16).view(np.uint16)
        for at in range(2, step + 1):
            w.reshape(-1)[np.random.default_rng(at).choice(w.size, w.size // 50, replace=False)] += 1
        return {"w": w.view(ml_dtypes.bfloat16), "b": rng.standard_normal(300).astype(np.float32)}

    def pieces_of(step, rank, world=2):
        m, rows = model(step), 64 // world
        held = {"w": ws.Piece(m["w"][rank * rows:(rank + 1) * rows], (rank * rows, 0), (64, 1024))}
        if rank == 0:
            held["b"] = m["b"]
        return held
""")
namespace: dict = {}
exec(MODEL, namespace)  # noqa: S102 - the same model text the writer processes run
model, pieces_of = namespace["model"], namespace["pieces_of"]

#: a rank of a job publishing steps 1..N in a loop, one ws.Delta for its life; rank 0 commits
#: each step (keep=2), rank 1 writes a step once the one before is committed (its base)
WRITER = MODEL + textwrap.dedent("""
    import sys, time
    folder, rank, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    delta = ws.Delta(anchor_every=3)
    for step in range(1, last + 1):
        while step > 1 and ((latest := ws.latest(folder)) is None or latest.step < step - 1):
            time.sleep(0.01)
        ws.publish_shard(folder, pieces_of(step, rank), step=step, rank=rank, world=2, attempt=0, delta=delta)
        if rank == 0:
            ws.commit_shards(folder, step=step, world=2, attempt=0, timeout=30, keep=2)
""")


def same(got: dict, step: int) -> None:
    want = model(step)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].tobytes() == value.tobytes(), (step, key)


def publish(folder, step, *, world=2, delta=True, keep=None, split=None):
    """Every rank's share of ``step``, one after another in this process, then the commit."""
    for rank in range(world):
        pieces = pieces_of(step, rank, world) if split is None else split(step, rank)
        ws.publish_shard(folder, pieces, step=step, rank=rank, world=world, attempt=0,
                         delta=delta[rank] if isinstance(delta, list) else delta)
    return ws.commit_shards(folder, step=step, world=world, attempt=0, timeout=10, keep=keep)


def members(folder, step):
    return sorted(p.name for p in (Path(folder) / f"step-{step:012d}.attempt-0").glob("rank-*.*")
                  if p.suffix not in (".done", ".blocks"))


def index_of(version):
    return ShardIndex.parse(Path(version.path).read_bytes())


def fetched_by_round(follower, folder, rounds, deltas, s3, held) -> dict[int, int]:
    """The bytes the S3 server sent while ``follower`` took each round of steps, published while it
    was stopped (by each round's last step), each checked bit-exact against what ``held()`` gives."""
    fetched = {}
    for steps in rounds:
        follower.stop()
        for step in steps:
            publish(folder, step, delta=deltas)
        s3.reset()
        follower.start()
        assert follower.wait(steps[-1], timeout=60).step == steps[-1]
        fetched[steps[-1]] = s3.bytes_sent()
        same(held(), steps[-1])
    return fetched


def test_two_writer_processes_publish_deltas_that_a_follower_reads_step_by_step(tmp_path):
    folder = tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(rank), "5"],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE)
             for rank in range(2)]
    seen = []
    for version in ws.follow(folder, poll=0.02, timeout=60):  # each yielded version whole, bit for bit
        try:
            same(ws.load(version), version.step)
        except ws.StoreNotFoundError:  # pruned (keep=2) before it was read: the writers went on
            continue
        seen.append(version.step)
        if version.step == 5:
            break
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
    assert seen[-1] == 5 and seen == sorted(seen)
    listed = versions.list_versions(folder)  # 4 is an anchor (3 was two deltas from 1); keep=2
    assert [(e.step, e.kind, e.base) for e in listed] == [(4, "sharded", None),
                                                          (5, "sharded-delta", "step-000000000004.wsindex")]
    assert members(folder, 5) == ["rank-00000.wsdelta", "rank-00001.wsdelta"]
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [f"step-00000000000{s}.attempt-0" for s in (4, 5)]
    full = sum((folder / "step-000000000004.attempt-0" / name).stat().st_size for name in members(folder, 4))
    delta = sum((folder / "step-000000000005.attempt-0" / name).stat().st_size for name in members(folder, 5))
    assert delta < 0.1 * full, (delta, full)


def test_retention_keeps_the_bases_a_kept_version_needs_and_ws_reads_them(tmp_path):
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    folder = tmp_path / "run"
    deltas = [ws.Delta(), ws.Delta()]
    for step in (1, 2, 3):
        version = publish(folder, step, delta=deltas, keep=1)
    assert [e.step for e in versions.list_versions(folder)] == [1, 2, 3]  # 3 builds on 2 and 1
    assert index_of(version).delta.chain == ("step-000000000002.wsindex", "step-000000000001.wsindex")
    same(ws.load(ws.latest(folder)), 3)
    with ws.open(version) as store:
        assert store.read_region("w", (slice(30, 34), slice(5, 900))).tobytes() == model(3)["w"][30:34, 5:900].tobytes()
    for args in (["verify", version.path], ["versions", str(folder)]):
        result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
    assert "sharded-delta" in result.output


def test_a_changed_layout_writes_a_full_version(tmp_path):
    folder = tmp_path / "run"
    publish(folder, 1)
    assert index_of(publish(folder, 2)).delta is not None and members(folder, 2)[0].endswith(".wsdelta")
    version = publish(folder, 3, world=4)  # four ranks now: every member full, no chain
    assert index_of(version).delta is None and all(m.endswith(".safetensors") for m in members(folder, 3))
    same(ws.load(version), 3)
    assert members(folder, 4) == [] and index_of(publish(folder, 4, world=4)).delta is not None

    def rows(step, rank):  # the same four ranks, the rows cut elsewhere: rank 0's pieces and rank 1's changed
        w, cut = model(step)["w"], [0, 10, 32, 48, 64]
        held = {"w": ws.Piece(w[cut[rank]:cut[rank + 1]], (cut[rank], 0), (64, 1024))}
        return held | ({"b": model(step)["b"]} if rank == 0 else {})

    version = publish(folder, 5, world=4, split=rows)
    assert [m.rsplit(".", 1)[1] for m in members(folder, 5)] == ["safetensors", "safetensors", "wsdelta", "wsdelta"]
    same(ws.load(version), 5)


def test_a_corrupt_or_missing_base_is_a_weightstore_error_naming_version_member_and_tensor(tmp_path):
    folder = tmp_path / "run"
    publish(folder, 1)
    version = publish(folder, 2)
    member = folder / "step-000000000002.attempt-0" / "rank-00001.wsdelta"
    data = bytearray(member.read_bytes())
    data[-2] ^= 0xFF  # in the payload of rank 1's last tensor, w
    member.write_bytes(bytes(data))
    with pytest.raises(ws.WeightStoreError) as caught:
        ws.load(version)
    assert caught.value.path == version.path and "rank-00001.wsdelta" in str(caught.value)
    assert caught.value.key == "w"
    base = folder / "step-000000000001.attempt-0" / "rank-00001.safetensors"  # another tensor under its names
    with ws.open(base) as store:
        swapped = {key: np.zeros((2, *store[key].shape), store[key].dtype) for key in store}
        metadata = store.metadata
    ws.save(base, swapped, metadata=metadata)
    with pytest.raises(ws.FormatError, match=r"rank-00001.wsdelta: is stored as a change of base .*, not bfloat16"):
        ws.load(version)  # refused from the sizes alone, before anything the size of the claim is allocated
    (folder / "step-000000000001.attempt-0" / "rank-00000.safetensors").unlink()
    with pytest.raises(ws.WeightStoreError, match=r"rank-00000.wsdelta.*needs its base "
                                                  r"step-000000000001.attempt-0/rank-00000.safetensors, which is missing"):
        ws.load(version)
    # the next publish reads its bases back: they fail, so it writes full members, which read
    version = publish(folder, 3)
    assert index_of(version).delta is None
    same(ws.load(version), 3)


def test_a_rank_whose_base_member_is_damaged_under_it_writes_its_member_full_next(tmp_path, caplog):
    """Each rank remembers its member: damaged on disk, the next publish sees the file changed,
    reads it back, and writes that rank's member full (logging the file), not a delta on it."""
    folder, deltas = tmp_path / "run", [ws.Delta(), ws.Delta()]
    publish(folder, 1, delta=deltas)
    publish(folder, 2, delta=deltas)
    anchor = folder / "step-000000000001.attempt-0" / "rank-00001.safetensors"
    data = bytearray(anchor.read_bytes())
    data[-2] ^= 0xFF  # inside rank 1's tensor w
    anchor.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="weightstore"):
        version = publish(folder, 3, delta=deltas)
    assert members(folder, 3) == ["rank-00000.wsdelta", "rank-00001.safetensors"]
    assert "its base member step-000000000002.attempt-0/rank-00001.wsdelta cannot be read back" in caplog.text
    assert "step-000000000001.attempt-0/rank-00001.safetensors" in caplog.text
    same(ws.load(version), 3)


def test_an_index_of_delta_members_without_a_chain_or_with_one_going_up_is_refused(tmp_path):
    folder = tmp_path / "run"
    publish(folder, 1)
    index = index_of(publish(folder, 2))
    for chain, words in ((None, "names delta members, and no chain"),
                         (("step-000000000009.wsindex",), "not of indexes of lower steps")):
        bad = dataclasses.replace(index, delta=None if chain is None else dataclasses.replace(index.delta, chain=chain))
        with pytest.raises(ws.FormatError, match=words):
            ShardIndex.parse(bad.to_json())


def test_on_s3_members_are_deltas_read_back_and_read_remote(s3):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    deltas = [ws.Delta(), ws.Delta(remember=False)]  # rank 1 reads its base member back from the bucket
    for step in (1, 2, 3):
        version = publish(folder, step, delta=deltas)
    assert [e.kind for e in versions.list_versions(folder)] == ["sharded", "sharded-delta", "sharded-delta"]
    same(ws.load(version), 3)
    with ws.open(version) as store:  # a region: its rows' stored tensors rebuilt from the chain
        assert store.read_region("w", (slice(40, 41),)).tobytes() == model(3)["w"][40:41].tobytes()
        assert [m.file.rsplit("/", 1)[1] for m in store._reader.index.members] == ["rank-00000.wsdelta",
                                                                                   "rank-00001.wsdelta"]


def test_a_serving_follower_keeps_the_right_weights_through_a_corrupt_delta_and_takes_the_next_anchor(tmp_path):
    torch = pytest.importorskip("torch")
    from weightstore.adapters.serving.follower import Follower

    module = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(64, 1024, dtype=torch.bfloat16)),
                                     "b": torch.nn.Parameter(torch.zeros(300))})

    def held():
        return {"w": module["w"].detach().view(torch.int16).numpy().view(model(1)["w"].dtype),
                "b": module["b"].detach().numpy()}

    deltas = [ws.Delta(anchor_every=3), ws.Delta(anchor_every=3)]
    with Follower(module, tmp_path, poll=0.02) as follower:
        for step in (1, 2):
            publish(tmp_path, step, delta=deltas)
            assert follower.wait(step, timeout=60).step == step
            same(held(), step)
        for rank in range(2):  # a delta whose rank 1 member is damaged before the commit names it, so
            ws.publish_shard(tmp_path, pieces_of(3, rank, 2), step=3, rank=rank, world=2, attempt=0,
                             delta=deltas[rank])  # the follower never meets it whole
        member = tmp_path / "step-000000000003.attempt-0" / "rank-00001.wsdelta"
        data = bytearray(member.read_bytes())
        data[-2] ^= 0xFF
        member.write_bytes(bytes(data))
        ws.commit_shards(tmp_path, step=3, world=2, attempt=0, timeout=10)
        with pytest.raises(ws.WeightStoreError, match="rank-00001.wsdelta"):
            follower.wait(3, timeout=60)
        same(held(), 2)  # never wrong weights: step 2's, whole
        assert index_of(publish(tmp_path, 4, delta=deltas)).delta is None  # the next anchor (3 from 1)
        assert follower.wait(4, timeout=60).step == 4
        same(held(), 4)


def test_a_follower_of_sharded_deltas_on_s3_fetches_the_deltas_not_the_anchor(s3):
    """Each rank's delta member is applied onto the follower's held copy (digests checked): a
    version costs about its deltas, and after missed versions it takes the chain from the version
    it holds, never more than a full one; the weights are bit-exact each time."""
    torch = pytest.importorskip("torch")
    from weightstore.adapters.serving.follower import Follower

    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    module = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(64, 1024, dtype=torch.bfloat16)),
                                     "b": torch.nn.Parameter(torch.zeros(300))})

    def held():
        return {"w": module["w"].detach().view(torch.int16).numpy().view(model(1)["w"].dtype),
                "b": module["b"].detach().numpy()}

    deltas = [ws.Delta(anchor_every=20), ws.Delta(anchor_every=20)]
    full = sum(value.nbytes for value in model(1).values())
    follower = Follower(module, folder, poll=0.02, deltas=True)
    try:  # followed one by one, then 3 missed
        fetched = fetched_by_round(follower, folder, ([1], [2], [3], [4, 5, 6, 7]), deltas, s3, held)
    finally:
        follower.stop()
    assert {e.kind for e in versions.list_versions(folder) if e.step > 1} == {"sharded-delta"}
    assert all(fetched[step] < full / 4 for step in (2, 3)), fetched  # the anchor alone is a full version
    assert fetched[7] < full / 2, fetched


def test_a_follower_reads_whole_a_tensor_a_full_member_holds_part_of(tmp_path):
    """Rank 1 writes its member full: ``w``'s run there cannot be rebuilt onto the held copy, so
    ``w`` is read whole (rank 0's run already rebuilt in it is let go); the weights are bit-exact."""
    torch = pytest.importorskip("torch")
    from weightstore.adapters.serving.follower import Follower

    module = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(64, 1024, dtype=torch.bfloat16)),
                                     "b": torch.nn.Parameter(torch.zeros(300))})
    deltas = [ws.Delta(), False]
    with Follower(module, tmp_path, poll=0.02, deltas=True) as follower:
        for step in (1, 2):
            publish(tmp_path, step, delta=deltas)
            assert follower.wait(step, timeout=60).step == step
            assert follower.error is None
            w = module["w"].detach().view(torch.int16).numpy()
            assert w.tobytes() == model(step)["w"].tobytes() and module["b"].detach().numpy().tobytes() == \
                model(step)["b"].tobytes()
    assert [e.kind for e in versions.list_versions(tmp_path)] == ["sharded", "sharded-delta"]
    assert members(tmp_path, 2) == ["rank-00000.wsdelta", "rank-00001.safetensors"]


def test_a_reader_counts_each_delta_member_s_chain_against_its_open_files_and_refuses_one_over(tmp_path,
                                                                                                monkeypatch):
    """Each member of step 6 holds 6 files open (itself and 5 bases down to its anchor): under a
    budget of 8 files the two are opened in turn, never both, nor a block table beside a chain
    being opened (at most 8 descriptors more at any open), and read bit-exact; under 5 the chain
    alone is over, refused naming version, member and tensor, with no descriptor left open. A
    member closed, then pruned, is refused naming version and tensor when asked what a read from
    a held version would fetch."""
    from weightstore.formats import sharded
    from weightstore.io._writeback import behind

    folder = tmp_path / "run"
    deltas = [ws.Delta(anchor_every=10), ws.Delta(anchor_every=10)]
    for step in range(1, 7):
        version = publish(folder, step, delta=deltas)
    assert len(index_of(version).delta.chain) == 5

    def descriptors() -> int:  # those open on the version's files: other threads of the worker open files too
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed since it was listed
                found += os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder))
        return found

    behind(lambda: None).result()  # the commits' closes of the files they replaced, left to the writeback thread
    before = descriptors()
    peak = [0]
    os_open = os.open

    def counted(*args, **words):  # every file weightstore reads is opened here: the count peaks just after one
        fd = os_open(*args, **words)
        peak[0] = max(peak[0], descriptors() - before)
        return fd

    monkeypatch.setattr(sharded, "open_files_limit", lambda: 8)
    with ws.open(version) as store:
        assert descriptors() == before  # 12 files would not fit: none opened yet
        monkeypatch.setattr(os, "open", counted)
        same({key: store[key] for key in store}, 6)
        assert store._reader._open_files == 6 and descriptors() == before + 6
        assert store.read_region("w", (slice(0, 2),)).tobytes() == model(6)["w"][:2].tobytes()  # rank 0 again
        assert store._reader._open_files == 6 and descriptors() == before + 6
        monkeypatch.setattr(os, "open", os_open)
    assert 6 <= peak[0] <= 8, peak
    assert descriptors() == before
    monkeypatch.setattr(sharded, "open_files_limit", lambda: 5)
    with ws.open(version) as store:
        with pytest.raises(ws.SizeLimitError) as caught:
            store.read_region("w", (slice(40, 41),))
        assert caught.value.path == version.path and caught.value.key == "w"
        assert "rank-00001.wsdelta" in str(caught.value) and "6 files down to its anchor" in str(caught.value)
        assert descriptors() == before
    assert descriptors() == before
    monkeypatch.setattr(sharded, "open_files_limit", lambda: 12)
    with ws.open(version) as store:  # both fit: opened whole at open, as ever
        assert store._reader._open_files == 12 and descriptors() == before + 12
        same({key: store[key] for key in store}, 6)
    monkeypatch.setattr(sharded, "open_files_limit", lambda: 8)
    with ws.open(version) as store:
        assert store["w"].tobytes() == model(6)["w"].tobytes()  # both tables read; rank 1's member left open
        (Path(version.path).parent / "step-000000000006.attempt-0" / "rank-00000.wsdelta").unlink()
        with pytest.raises(ws.StoreNotFoundError) as caught:
            store.chain_payload(["w"], index_of(version).delta.chain[-1])
        assert caught.value.path == version.path and caught.value.key == "w"
        assert "rank-00000.wsdelta" in str(caught.value)


def test_threads_reading_a_delta_member_rebuild_its_tensors_in_parallel_each_once(tmp_path, monkeypatch):
    """Four tensors of one delta member, each read by three threads at once: the four are rebuilt
    at the same time (each rebuild waits for the other three), each once (its rebuild waits
    until all three of its reads hold it), and every read gets the tensor bit-exact."""
    import threading

    from weightstore.formats import delta as delta_format

    def weights(step):
        rng = np.random.default_rng(3)
        found = {f"k{i}": rng.standard_normal((128, 128)).astype(np.float32) for i in range(4)}
        for value in found.values():
            value[step, :3] += step  # a few elements move a step
        return found

    folder, planner = tmp_path / "run", ws.Delta()
    for step in (1, 2):
        ws.publish_shard(folder, weights(step), step=step, rank=0, world=1, attempt=0, delta=planner)
        version = ws.commit_shards(folder, step=step, world=1, attempt=0, timeout=10)
    assert members(folder, 2) == ["rank-00000.wsdelta"]
    want, rebuilds, together = weights(2), {}, threading.Barrier(4, timeout=60)
    stored_bytes = delta_format.DeltaReader.stored_bytes

    def rebuilding(self, key, **words):
        rebuilds[key] = rebuilds.get(key, 0) + 1
        together.wait()  # the other tensors are being rebuilt now too
        entry = member._wanted[member._keys.index(key)]
        deadline = time.monotonic() + 60
        while entry.reads < 3:  # this tensor's other two reads wait for this rebuild
            assert time.monotonic() < deadline, f"{key}: {entry.reads} of 3 reads hold it after 60 s"
            threading.Event().wait(0.001)
        return stored_bytes(self, key, **words)

    monkeypatch.setattr(delta_format.DeltaReader, "stored_bytes", rebuilding)
    got: dict = {}
    with ws.open(version) as store:
        (member,) = store._reader._files.values()

        def read(key, at):
            got[key, at] = store[key]

        threads = [threading.Thread(target=read, args=(key, at), daemon=True) for key in want for at in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads)
        assert member._wanted == {}  # each read to its end: none kept
    assert rebuilds == {key: 1 for key in want}
    assert sorted(got) == sorted((key, at) for key in want for at in range(3))
    assert all(value.tobytes() == want[key].tobytes() for (key, _), value in got.items())


def tf1_parts(parts: int):
    """A finalized TF1 session holding the model, ``w`` partitioned by rows ``parts`` ways (3: rows
    0-22, 22-43, 43-64, across the two ranks' pieces of 32 rows, each stored as column strips)."""
    tf = pytest.importorskip("tensorflow")
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        v1.get_variable("w", (64, 1024), tf.bfloat16, v1.zeros_initializer(),
                        partitioner=v1.fixed_size_partitioner(parts))
        v1.get_variable("b", (300,), tf.float32, v1.zeros_initializer())
        init = v1.global_variables_initializer()
    session = v1.Session(graph=graph)
    session.run(init)
    graph.finalize()
    return session


def test_a_follower_of_tf1_parts_across_the_writers_pieces_fetches_the_deltas_not_the_anchor(s3):
    """Each region a TF1 follower stages is rebuilt from its copies of the regions it held: each
    rank's strip is assembled from the held regions it lies across (its rows 0-32 from two
    parts), its deltas since applied and its digest checked. A version costs about its deltas,
    the catch-up after missed versions less than a full version; the weights are bit-exact."""
    from weightstore.adapters import tf1
    from weightstore.adapters.serving.follower import Follower

    session = tf1_parts(3)
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    deltas = [ws.Delta(), ws.Delta()]
    full = sum(value.nbytes for value in model(1).values())
    follower = Follower(session, folder, poll=0.02, deltas=True)
    try:  # followed one by one, then 2 missed
        fetched = fetched_by_round(follower, folder, ([1], [2], [3], [4, 5, 6]), deltas, s3,
                                   lambda: tf1.export(session))
    finally:
        follower.stop()
    assert fetched[1] > full  # the first, whole
    assert all(fetched[step] < full / 4 for step in (2, 3)) and fetched[6] < full / 2, fetched


def test_a_follower_of_tf1_parts_whose_held_copy_is_not_the_base_reads_them_from_the_anchor(tmp_path, caplog,
                                                                                            monkeypatch):
    """A held region whose bytes are not those of the version held (changed in memory) gives a
    strip that does not rebuild its rank's digest: logged, the regions are read from the anchor
    and chain, bit-exact, and the next version is rebuilt onto the copies of those. The store
    rebuilds a region only from held regions that cover its strips, of a version in its chain,
    and refuses bytes that are not that version's, or bounds that are not a region's of the size
    given, naming the version and the tensor."""
    from weightstore.adapters import tf1
    from weightstore.adapters.serving.follower import Follower

    rebuilt = []
    read_regions_from = ws.Store.read_regions_from

    def spied(self, key, held, have, wanted):
        found = read_regions_from(self, key, held, have, wanted)
        rebuilt.extend((self.path[-len("1.wsindex"):], bounds[0], array is not None)
                       for bounds, array in zip(wanted, found, strict=True))
        return found

    monkeypatch.setattr(ws.Store, "read_regions_from", spied)
    session = tf1_parts(3)
    deltas = [ws.Delta(), ws.Delta()]
    with Follower(session, tmp_path, poll=0.02, deltas=True) as follower:
        publish(tmp_path, 1, delta=deltas)
        assert follower.wait(1, timeout=60).step == 1
        held = next(buffer for item, (_, buffer) in follower._held.items() if item == ("w", ((22, 43), (0, 1024))))
        held[100] ^= 0xFF  # row 22, which rank 0's strips rebuild from (rows 0-32)
        with caplog.at_level("WARNING"):
            publish(tmp_path, 2, delta=deltas)
            assert follower.wait(2, timeout=60).step == 2
        assert "applying step 2 onto step 1 failed" in caplog.text and "does not give the digest" in caplog.text
        same(tf1.export(session), 2)
        caplog.clear()
        with caplog.at_level("WARNING"):
            version = publish(tmp_path, 3, delta=deltas)
            assert follower.wait(3, timeout=60).step == 3
        assert caplog.text == ""
        same(tf1.export(session), 3)
    # step 2's rebuilt regions were let go (the failure); step 3's each rebuilt onto the held copies
    assert sorted(found for found in rebuilt if found[0] == "3.wsindex") == \
        [("3.wsindex", rows, True) for rows in ((0, 22), (22, 43), (43, 64))]
    regions = [((0, 22), (0, 1024)), ((22, 43), (0, 1024)), ((43, 64), (0, 1024))]
    have = [(bounds, model(2)["w"][slice(*bounds[0])]) for bounds in regions]
    with ws.open(version) as store:
        rebuilt = store.read_regions_from("w", "step-000000000002.wsindex", have, regions)
        assert [array.tobytes() for array in rebuilt] == [model(3)["w"][slice(*bounds[0])].tobytes()
                                                          for bounds in regions]
        assert store.read_regions_from("w", "step-000000000002.wsindex", have[:1], regions[:1]) == [None]
        assert store.read_regions_from("w", "step-000000000009.wsindex", have, regions[:1]) == [None]  # not its chain
        with pytest.raises(ws.ChecksumError) as caught:  # step 2's bytes given as step 1's
            store.read_regions_from("w", "step-000000000001.wsindex", have, regions[:1])
        assert caught.value.path == version.path and caught.value.key == "w"
        for bad_have, bad_wanted in (([(regions[0], model(2)["w"][:21])], regions[:1]),  # a row short
                                     (have, [((0, 65), (0, 1024))]), (have, [((0, 22),)])):  # outside; an axis short
            with pytest.raises(ws.TargetError) as caught:
                store.read_regions_from("w", "step-000000000002.wsindex", bad_have, bad_wanted)
            assert caught.value.path == version.path and caught.value.key == "w"


def test_a_follower_of_tf1_parts_reads_the_regions_a_full_member_holds_part_of(tmp_path, monkeypatch):
    """Rank 1 writes its member full: the part of rows 0-22 (rank 0's strips alone) is rebuilt
    onto the held copies, the two that hold rank 1's rows are read from the version; bit-exact."""
    from weightstore.adapters import tf1
    from weightstore.adapters.serving.follower import Follower

    rebuilt = []
    read_regions_from = ws.Store.read_regions_from

    def spied(self, key, held, have, wanted):
        found = read_regions_from(self, key, held, have, wanted)
        rebuilt.extend((bounds[0], array is not None) for bounds, array in zip(wanted, found, strict=True))
        return found

    monkeypatch.setattr(ws.Store, "read_regions_from", spied)
    session = tf1_parts(3)
    deltas = [ws.Delta(), False]
    with Follower(session, tmp_path, poll=0.02, deltas=True) as follower:
        for step in (1, 2):
            publish(tmp_path, step, delta=deltas)
            assert follower.wait(step, timeout=60).step == step
            assert follower.error is None
            same(tf1.export(session), step)
    assert members(tmp_path, 2) == ["rank-00000.wsdelta", "rank-00001.safetensors"]
    assert sorted(rebuilt) == [((0, 22), True), ((22, 43), False), ((43, 64), False)]


def scalar_model_w(step: int) -> np.ndarray:
    w = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    w[:, 0] = step
    return w


def scalar_pieces(step: int, rank: int) -> dict:
    """Step ``step`` of a model of ``w`` (64, 64) whose first column moves, rows split between
    two ranks (each member a delta until its chain adds up to it), and a scalar ``s`` on rank 0."""
    w = scalar_model_w(step)
    pieces: dict = {"w": ws.Piece(w[rank * 32 : (rank + 1) * 32], (rank * 32, 0), (64, 64))}
    if rank == 0:
        pieces["s"] = np.float32(step)
    return pieces


def open_files_under(folder) -> list[str]:
    """The files under ``folder`` this process holds open, once the writeback thread has closed what
    the last commits replaced (a replaced ``LATEST`` is closed there, after the swap)."""
    behind(lambda: None).result(30)
    fds = Path("/proc/self/fd")
    found = []
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            found.append(os.readlink(fd))
    return [path for path in found if path.startswith(str(folder))]


def test_a_scalar_of_a_sharded_delta_rebuilds_onto_its_held_bytes_and_a_closed_store_opens_no_member(tmp_path):
    """A 0-d tensor is rebuilt onto its bytes of the version before like any other, whole and as
    its one region. A closed store refuses before it opens a member again; bounds that are not
    integers with 0 <= start <= stop <= size (a bool too, though Python counts it one) are a
    TargetError naming the version and tensor."""
    deltas = [ws.Delta(), ws.Delta()]
    for step in (1, 2):
        version = publish(tmp_path, step, delta=deltas, split=scalar_pieces)
    held, before = "step-000000000001.wsindex", np.array([1], np.float32).view(np.uint8)
    assert [m.split(".")[-1] for m in members(tmp_path, 2)] == ["wsdelta", "wsdelta"]
    store = ws.open(version)
    with store:
        assert store.read_from("s", held, before.copy()).tobytes() == np.float32(2).tobytes()
        assert store.read_from("s", held, before.copy(), in_place=True).tobytes() == np.float32(2).tobytes()
        assert [a.tobytes() for a in store.read_regions_from("s", held, [((), np.float32(1))], [()])] == \
            [np.float32(2).tobytes()]
        rows = [((0, 40), (0, 64)), ((40, 64), (0, 64))]  # rows 0-32 from both
        have = [(bounds, scalar_model_w(1)[slice(*bounds[0])]) for bounds in rows]
        assert [a.tobytes() for a in store.read_regions_from("w", held, have, rows)] == \
            [scalar_model_w(2)[slice(*bounds[0])].tobytes() for bounds in rows]
        for bad in (((-3, 64), (0, 64)), ((5, 2), (0, 64)), ((0, 65), (0, 64)), ((0.0, 64), (0, 64)), ((0, 40), (False, 64)),
                    (5, (0, 64)), 5):
            with pytest.raises(ws.TargetError) as caught:
                store.read_regions_from("w", held, have, [bad])
            assert caught.value.path == version.path and caught.value.key == "w", bad
            with pytest.raises(ws.TargetError) as caught:
                store.read_regions_from("w", held, [(bad, have[0][1])], rows)
            assert caught.value.path == version.path and caught.value.key == "w", bad
    assert open_files_under(tmp_path) == []
    for read in (lambda: store.read_from("w", held, scalar_model_w(1)),
                 lambda: store.read_from("s", held, before.copy(), in_place=True),
                 lambda: store.read_regions_from("w", held, have, rows)):
        with pytest.raises(ws.StoreClosedError):
            read()
        assert open_files_under(tmp_path) == []


def test_a_tf1_follower_of_a_scalar_takes_each_sharded_delta_rebuilt_and_reads_the_anchor_when_a_rebuild_breaks(
        tmp_path, monkeypatch, caplog):
    """A session holding ``w`` (64, 64) and a scalar takes every delta version, both rebuilt onto
    its held copies; a rebuild that fails with any error, not only a WeightStoreError, is logged
    and the version read from its anchor and chain: never wrong weights, never a stuck follower."""
    tf = pytest.importorskip("tensorflow")
    from weightstore.adapters import tf1
    from weightstore.adapters.serving.follower import Follower

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        v1.get_variable("w", (64, 64), tf.float32, v1.zeros_initializer())
        v1.get_variable("s", (), tf.float32, v1.zeros_initializer())
        init = v1.global_variables_initializer()
    session = v1.Session(graph=graph)
    session.run(init)
    graph.finalize()
    rebuilt = []
    read_from = ws.Store.read_from

    def spied(self, key, held, data, *, in_place=False):
        if key == "s" and self.path.endswith("step-000000000004.wsindex"):
            raise RuntimeError("a bug in a rebuild")
        found = read_from(self, key, held, data, in_place=in_place)
        rebuilt.append((self.path[-len("1.wsindex"):], key, found is not None))
        return found

    monkeypatch.setattr(ws.Store, "read_from", spied)
    deltas = [ws.Delta(), ws.Delta()]
    with Follower(session, tmp_path, poll=0.02, deltas=True) as follower:
        for step in (1, 2, 3, 4, 5):
            with caplog.at_level("WARNING"):
                publish(tmp_path, step, delta=deltas, split=scalar_pieces)
                assert follower.wait(step, timeout=60).step == step
            assert follower.error is None
            assert ("applying step 4 onto step 3 failed" in caplog.text) == (step == 4) and \
                ("a bug in a rebuild" in caplog.text) == (step == 4), caplog.text
            caplog.clear()
            got = tf1.export(session)
            assert got["s"].tobytes() == np.float32(step).tobytes()
            assert got["w"].tobytes() == scalar_model_w(step).tobytes()
    # step 4's ``w`` may be rebuilt before its ``s`` fails: all of it is read from the anchor anyway
    assert sorted(set(rebuilt) - {("4.wsindex", "w", True)}) == \
        [(f"{step}.wsindex", key, True) for step in (2, 3, 5) for key in ("s", "w")]


def test_a_tf1_follower_passes_over_the_held_regions_of_a_tensor_whose_shape_changed(tmp_path):
    """Step 2 stores ``w`` with half its rows: the regions held of it lie outside it, so they are
    let go, not asked for a digest that fails the version; ``strict=False`` leaves the session's
    ``w`` as it was and takes ``b``; step 3, ``w`` as before, is read whole, bit-exact."""
    from weightstore.adapters import tf1
    from weightstore.adapters.serving.follower import Follower

    def halved(step, rank):
        pieces = pieces_of(step, rank)
        pieces["w"] = ws.Piece(model(step)["w"][rank * 16 : (rank + 1) * 16], (rank * 16, 0), (32, 1024))
        return pieces

    session = tf1_parts(3)
    deltas = [ws.Delta(), ws.Delta()]
    with Follower(session, tmp_path, poll=0.02, deltas=True, strict=False) as follower:
        publish(tmp_path, 1, delta=deltas)
        assert follower.wait(1, timeout=60).step == 1
        assert any(isinstance(item, tuple) and item[1][0] == (43, 64) for item in follower._held)
        publish(tmp_path, 2, delta=deltas, split=halved)
        assert follower.wait(2, timeout=60).step == 2
        assert follower.error is None
        got = tf1.export(session)
        assert got["b"].tobytes() == model(2)["b"].tobytes() and got["w"].tobytes() == model(1)["w"].tobytes()
        publish(tmp_path, 3, delta=deltas)
        assert follower.wait(3, timeout=60).step == 3
        assert follower.error is None
        same(tf1.export(session), 3)


def test_a_sharded_delta_whose_base_is_no_longer_latest_is_refused_not_committed_off_the_line(tmp_path):
    """Another coordinator (or a plain publish) committed a step after the ranks wrote their
    members as deltas of the version LATEST named: committed, the index would build on a version
    off the line and retention would prune its base. Refused, telling to publish the step again;
    LATEST stays on the other step and every kept version reads."""
    folder = tmp_path / "run"
    deltas = [ws.Delta(), ws.Delta()]
    for step in (1, 2):
        publish(folder, step, delta=deltas, keep=2)
    for rank in range(2):
        ws.publish_shard(folder, pieces_of(4, rank), step=4, rank=rank, world=2, attempt=0, delta=deltas[rank])
    assert all(name.endswith(".wsdelta") for name in members(folder, 4))
    ws.publish(folder, model(3), step=3, keep=2)  # the other publisher, between the ranks and the commit
    with pytest.raises(ws.PublishError) as caught:
        ws.commit_shards(folder, step=4, world=2, attempt=0, timeout=10, keep=2)
    message = str(caught.value)
    assert "LATEST moved to step 3" in message and "publish step 4 again" in message
    assert ws.latest(folder).step == 3
    for entry in versions.list_versions(folder):
        same(ws.load(entry.path), entry.step)
    # doing as the message says: every rank publishes step 4 again (the same attempt, the same
    # Deltas, which now build on what LATEST names), and a follower holding step 3 reads it bit-exact
    following = ws.follow(folder, after=2, timeout=30)
    held = next(following)
    assert held.step == 3
    same(ws.load(held), 3)
    version = publish(folder, 4, delta=deltas, keep=2)
    assert version.step == 4 and ws.latest(folder).step == 4
    # the refused try's deltas (LATEST named a plain version, so the ranks wrote whole members) are
    # no member of the version: its commit removed them rather than leave them until step 4 is pruned
    assert members(folder, 4) == [Path(member.file).name for member in index_of(version).members] == [
        "rank-00000.safetensors", "rank-00001.safetensors"]
    got = next(following)
    assert got.step == 4
    same(ws.load(got), 4)
    following.close()
    for entry in versions.list_versions(folder):
        same(ws.load(entry.path), entry.step)
