"""Sharded versions: many writer processes, one coordinator, readers partitioned their own way."""

import datetime
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from processes import fork_together, run_forked

import hostile
import weightstore as ws
from weightstore import sync as versions
from weightstore.core import limits
from weightstore.formats._sharded_index import PAGE_CRCS, ShardIndex, seal
from weightstore.sharded import _shards as shards
from weightstore.sync import _publish

ROOT = Path(__file__).resolve().parents[1]

#: the model every writer process and the test build alike, and how the ranks split it
MODEL = textwrap.dedent("""
    import numpy as np, ml_dtypes
    import weightstore as ws

    def model():
        rng = np.random.default_rng(23)
        return {
            "dense/kernel": rng.standard_normal((96, 2048)).astype(np.float32),
            "dense/bias": rng.standard_normal(2048).astype(np.float32),
            "emb": rng.standard_normal((64, 512)).astype(ml_dtypes.bfloat16),
            "two": rng.standard_normal((40, 8)).astype(np.float32),
            "step": np.array(7, np.int64),
        }

    def pieces_of(rank, world=4):
        m, rows = model(), 96 // world
        held = {"dense/kernel": ws.Piece(m["dense/kernel"][rank * rows:(rank + 1) * rows], (rank * rows, 0), (96, 2048)),
                "emb": ws.Piece(m["emb"][:, rank * 128:(rank + 1) * 128], (0, rank * 128), (64, 512))}
        if rank == 0:
            held["step"] = m["step"]
        if rank == 3:
            held["dense/bias"] = m["dense/bias"]
        if rank == 1:  # two pieces of one key in one member
            held["two"] = [ws.Piece(m["two"][0:10], (0, 0), (40, 8)), ws.Piece(m["two"][20:30], (20, 0), (40, 8))]
        if rank == 2:
            held["two"] = [ws.Piece(m["two"][10:20], (10, 0), (40, 8)), ws.Piece(m["two"][30:40], (30, 0), (40, 8))]
        return held
""")
namespace: dict = {}
exec(MODEL, namespace)  # noqa: S102 - the same model text the writer processes run
model, pieces_of = namespace["model"], namespace["pieces_of"]
#: rank 1's piece of dense/kernel (24 x 2048 float32, 192 KiB) as its member stores it: strips of 64 columns
KERNEL_STRIPS = [f"dense/kernel@24,{column}" for column in range(0, 2048, 64)]

WRITER = MODEL + textwrap.dedent("""
    import os, sys
    from weightstore.sync import _stages as stages
    folder, rank, attempt, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    def stage(name):
        if name == kill_at:
            os.kill(os.getpid(), 9)
    stages.hook = stage
    ws.publish_shard(folder, pieces_of(rank), step=int(sys.argv[5]), rank=rank, world=4, attempt=attempt)
""")


#: what every writer imports, once, in the interpreter they are forked from
WRITER_IMPORTS = "import ml_dtypes, weightstore\nfrom weightstore.formats import format_named\nformat_named('safetensors')"


def write_ranks(folder, *, step=2, attempt=0, kill=None, ranks=range(4)):
    """Writer processes at once, one per rank; ``kill``: (rank, stage) that rank SIGKILLs itself at."""
    writers = fork_together(WRITER_IMPORTS, WRITER, [[str(folder), str(rank), str(attempt),
                                                      kill[1] if kill and kill[0] == rank else "", str(step)]
                                                     for rank in ranks],
                            [{**os.environ, "PYTHONPATH": str(ROOT)}] * len(ranks), timeout=120)
    for writer in writers:
        assert writer.returncode in (0, -9), writer.stderr
    return [writer.returncode for writer in writers]


def test_four_writers_read_back_in_any_partitioning(tmp_path):
    folder = tmp_path / "run"
    ws.publish(folder, {"dense/kernel": np.zeros(3)}, step=1)
    assert write_ranks(folder) == [0, 0, 0, 0]
    assert ws.latest(folder).step == 1  # nothing visible before the commit
    version = shards.commit_shards(folder, step=2, world=4, attempt=0, timeout=10, metadata={"loss": 0.5})
    assert Path(version.path).name == "step-000000000002.wsindex"
    assert ws.latest(folder).path == version.path and ws.latest(folder).metadata == {"loss": 0.5}
    expected = model()
    with ws.open(ws.latest(folder)) as store:
        assert sorted(store) == sorted(expected)
        assert store.info("emb").dtype == "bfloat16" and store.info("emb").shape == (64, 512)
        for key, value in expected.items():  # whole
            assert store[key].dtype == value.dtype and store[key].tobytes() == value.tobytes(), key
        kernel = expected["dense/kernel"]
        for part in range(3):  # 3 ways after 4, by rows
            rows = slice(part * 32, (part + 1) * 32)
            assert store.read_region("dense/kernel", (rows,)).tobytes() == kernel[rows].tobytes()
        for part in range(4):  # columns after rows, rows after columns
            cols = slice(part * 512, (part + 1) * 512)
            assert store.read_region("dense/kernel", (slice(None), cols)).tobytes() == kernel[:, cols].tobytes()
            assert store.read_region("emb", (slice(part * 16, part * 16 + 16),)).tobytes() == (
                expected["emb"][part * 16:part * 16 + 16].tobytes())
        assert store.read_region("two", (slice(5, 35), slice(2, 3))).tobytes() == expected["two"][5:35, 2:3].tobytes()
    loaded = ws.load(version, regions={"dense/kernel": (slice(10, 50), slice(7, 9))})
    assert loaded["dense/kernel"].tobytes() == kernel[10:50, 7:9].tobytes()
    assert loaded["step"] == 7
    # each member stands alone: an ordinary safetensors file under the global keys
    from safetensors.numpy import load_file

    member = folder / "step-000000000002.attempt-0" / "rank-00001.safetensors"
    assert sorted(load_file(str(member))) == sorted([*KERNEL_STRIPS, "emb", "two@0,0", "two@20,0"])
    with ws.open(member) as alone:
        assert alone.metadata[shards.SHARD_METADATA]["pieces"]["two@20,0"] == {"key": "two", "start": [20, 0],
                                                                              "shape": [40, 8]}
    # steps go on across plain and sharded versions
    with pytest.raises(ws.PublishError, match="not after step 2"):
        ws.publish(folder, {"a": np.zeros(1)}, step=2)
    ws.publish(folder, {"a": np.zeros(1)}, step=3)


def test_a_killed_writer_times_out_and_a_retry_commits(tmp_path):
    folder = tmp_path / "run"
    ws.publish(folder, {"a": np.zeros(1)}, step=1)
    for rank in (0, 1, 3):
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=0)
    assert write_ranks(folder, kill=(2, "member-temporary"), ranks=[2]) == [-9]  # SIGKILLed mid-save
    with pytest.raises(ws.ShardTimeoutError, match="rank 2 of 4 did not finish") as caught:
        shards.commit_shards(folder, step=2, world=4, attempt=0, timeout=0.5)
    assert caught.value.missing == [2] and isinstance(caught.value, TimeoutError)
    assert ws.latest(folder).step == 1 and not (folder / "step-000000000002.wsindex").exists()
    for rank in range(4):  # the job restarts: attempt 1
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=1)
    version = shards.commit_shards(folder, step=2, world=4, attempt=1, timeout=5)
    assert ws.latest(folder).step == 2
    assert ws.load(version)["two"].tobytes() == model()["two"].tobytes()
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["step-000000000002.attempt-1"]


@pytest.mark.parametrize("retry", [0, 1])  # the coordinator alone, or the job with the next attempt
def test_a_killed_coordinator_leaves_nothing_visible_and_the_retry_commits(tmp_path, retry):
    folder = tmp_path / "run"
    ws.publish(folder, {"a": np.zeros(1)}, step=1)
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=0)
    script = ("import sys; from weightstore.sharded import _shards as shards; from weightstore.sync import _stages as stages; import os\n"
              "stages.hook = lambda s: s == 'index-written' and os.kill(os.getpid(), 9)\n"
              f"shards.commit_shards({str(folder)!r}, step=2, world=4, attempt=0, timeout=5)\n")
    proc = run_forked(script, timeout=60)  # a coordinator process of its own
    assert proc.returncode == -9, proc.stderr
    assert (folder / "step-000000000002.wsindex").exists() and ws.latest(folder).step == 1
    for rank in range(4 if retry else 0):
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=retry)
    version = shards.commit_shards(folder, step=2, world=4, attempt=retry, timeout=5)
    assert ws.latest(folder).step == 2 and ws.load(version)["step"] == 7
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [f"step-000000000002.attempt-{retry}"]


def test_two_coordinators_racing_one_step_locally(tmp_path):
    folder = tmp_path / "run"
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=0)
    results = []
    threads = [threading.Thread(target=lambda: results.append(_outcome(shards.commit_shards, folder)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(type(r).__name__ for r in results) == ["PublishError", "Version"]
    assert ws.latest(folder).step == 2


def _outcome(commit, folder):
    try:
        return commit(folder, step=2, world=4, attempt=0, timeout=5)
    except ws.PublishError as exc:
        return exc


@pytest.mark.parametrize("case, words", [
    ("overlap", "overlap"),
    ("gap", "do not cover"),
    ("dtype", "disagree"),
    ("shape", "disagree"),
])
def test_pieces_that_do_not_tile_are_refused_naming_the_key(tmp_path, case, words):
    folder = tmp_path / "run"
    ws.publish(folder, {"a": np.zeros(1)}, step=1)
    a = np.arange(12, dtype=np.float32).reshape(6, 2)
    rank0 = {"w": ws.Piece(a[:3], (0, 0), (6, 2))}
    rank1 = {
        "overlap": {"w": ws.Piece(a[2:], (2, 0), (6, 2))},
        "gap": {"w": ws.Piece(a[4:], (4, 0), (6, 2))},
        "dtype": {"w": ws.Piece(a[3:].astype(np.float64), (3, 0), (6, 2))},
        "shape": {"w": ws.Piece(a[3:], (3, 0), (7, 2))},
    }[case]
    ws.publish_shard(folder, rank0, step=2, rank=0, world=2, attempt=0)
    ws.publish_shard(folder, rank1, step=2, rank=1, world=2, attempt=0)
    with pytest.raises(ws.PublishError, match=words) as caught:
        shards.commit_shards(folder, step=2, world=2, attempt=0, timeout=5)
    assert caught.value.key == "w"
    assert ws.latest(folder).step == 1 and not (folder / "step-000000000002.wsindex").exists()


def test_the_same_part_written_by_two_ranks_is_kept_once_and_diverged_replicas_refused(tmp_path):
    """Replicas that cannot tell which of them writes each write the part (FSDP2 over a layer
    tensor parallelism leaves alone); the index keeps one. The same part with other values is
    refused naming both ranks, and a part that overlaps another without being it names them too."""
    a = np.arange(12, dtype=np.float32).reshape(6, 2)
    for rank in range(2):  # each rank holds the tensor whole, and writes it whole
        ws.publish_shard(tmp_path / "same", {"w": a, "b": np.ones(2)}, step=1, rank=rank, world=2, attempt=0)
    version = shards.commit_shards(tmp_path / "same", step=1, world=2, attempt=0, timeout=5)
    assert np.array_equal(ws.load(version)["w"], a)
    with ws.open(version) as store:
        assert store.read_region("w", (slice(2, 4),)).tolist() == a[2:4].tolist()
    for rank, value in enumerate((a, a + 1)):
        ws.publish_shard(tmp_path / "diverged", {"w": value}, step=1, rank=rank, world=2, attempt=0)
    with pytest.raises(ws.PublishError, match=r"ranks 0 and 1 wrote the part at \[0, 0\] with different values"):
        shards.commit_shards(tmp_path / "diverged", step=1, world=2, attempt=0, timeout=5)
    for rank in range(2):  # replicas, one with digests and one without: whether they agree cannot be told
        ws.publish_shard(tmp_path / "mixed", {"w": a}, step=1, rank=rank, world=2, attempt=0, digests=rank == 0)
    with pytest.raises(ws.PublishError, match=r"one with block digests and one without.*digests=") as caught:
        shards.commit_shards(tmp_path / "mixed", step=1, world=2, attempt=0, timeout=5)
    assert caught.value.key == "w"
    for rank, dtype in enumerate((np.float32, np.float64)):  # not replicas: told as a disagreement
        ws.publish_shard(tmp_path / "dtypes", {"w": a.astype(dtype)}, step=1, rank=rank, world=2, attempt=0)
    with pytest.raises(ws.PublishError, match="ranks disagree on it: rank 0 has float32"):
        shards.commit_shards(tmp_path / "dtypes", step=1, world=2, attempt=0, timeout=5)
    for rank, start in enumerate((0, 2)):
        ws.publish_shard(tmp_path / "overlap", {"w": ws.Piece(a[start:start + 4], (start, 0), a.shape)}, step=1,
                         rank=rank, world=2, attempt=0)
    with pytest.raises(ws.PublishError, match=r"overlap: at \[0, 0\] \(rank 0\) and \[2, 0\] \(rank 1\)"):
        shards.commit_shards(tmp_path / "overlap", step=1, world=2, attempt=0, timeout=5)


def test_bad_pieces_are_refused_before_anything_is_written(tmp_path):
    folder = tmp_path / "run"
    member = str(folder / "step-000000000001.attempt-0" / "rank-00000.safetensors")
    bad = {  # every bad piece: one error, a PublishError and a ValueError, naming the member and the key
        r"a piece's array of shape \[3, 2\] at \[4, 0\] does not fit": ws.Piece(np.zeros((3, 2)), (4, 0), (6, 2)),
        "start at the same index": [ws.Piece(np.zeros((3, 2)), (0, 0), (6, 2))] * 2,
        r"a start must be a non-negative int, not 0.9": ws.Piece(np.zeros((3, 2)), (0.9, 0), (6, 2)),
        r"a start must be a non-negative int, not -1": ws.Piece(np.zeros((3, 2)), (-1, 0), (6, 2)),
        r"a start must be a non-negative int, not '0'": ws.Piece(np.zeros((3, 2)), ("0", 0), (6, 2)),
        r"a dimension of the shape must be a non-negative int": ws.Piece(np.zeros((3, 2)), (0, 0), (6, -2)),
        "start and shape must be sequences of ints": ws.Piece(np.zeros((3, 2)), 0, (6, 2)),
        "a list holds Pieces only": [ws.Piece(np.zeros((3, 2)), (0, 0), (6, 2)), np.zeros((3, 2))],
    }
    for words, value in bad.items():
        with pytest.raises(ws.PieceError, match=words) as caught:
            ws.publish_shard(folder, {"w": value}, step=1, rank=0, world=1, attempt=0)
        assert (caught.value.path, caught.value.key) == (member, "w")
        assert isinstance(caught.value, ws.PublishError) and isinstance(caught.value, ValueError)
    with pytest.raises(ws.PieceError, match="start at the same index") as caught:  # the key, '@' and all
        ws.publish_shard(folder, {"enc@v2/w": [ws.Piece(np.zeros((3, 2)), (0, 0), (6, 2))] * 2}, step=1, rank=0,
                         world=1, attempt=0)
    assert caught.value.key == "enc@v2/w"
    with pytest.raises(ws.UnsupportedDTypeError) as caught:
        ws.publish_shard(folder, {"w": np.array(["x"], object)}, step=1, rank=0, world=1, attempt=0)
    assert (caught.value.path, caught.value.key) == (member, "w")
    with pytest.raises(ws.InvalidKeyError) as caught:
        ws.publish_shard(folder, {"a//b": np.zeros(2)}, step=1, rank=0, world=1, attempt=0)
    assert (caught.value.path, caught.value.key) == (member, "a//b")
    with pytest.raises(ValueError, match="rank 2 is not below world 2"):
        ws.publish_shard(folder, {"w": np.zeros(2)}, step=1, rank=2, world=2, attempt=0)
    with pytest.raises(ValueError, match="timeout must be seconds"):
        shards.commit_shards(folder, step=1, world=1, attempt=0, timeout=float("nan"))
    assert not folder.exists() or not any(folder.rglob("*.safetensors"))
    ws.publish(folder, {"a": np.zeros(1)}, step=5)
    with pytest.raises(ws.PublishError, match="not after step 5"):
        ws.publish_shard(folder, {"w": np.zeros(2)}, step=5, rank=0, world=1, attempt=0)


def test_follow_latest_and_retention_treat_a_sharded_version_like_any(tmp_path):
    folder = tmp_path / "run"
    for step in (1, 2, 3):
        for rank in range(2):
            ws.publish_shard(folder, {"w": ws.Piece(np.full((2, 3), step, np.float32), (2 * rank, 0), (4, 3))},
                             step=step, rank=rank, world=2, attempt=0)
        shards.commit_shards(folder, step=step, world=2, attempt=0, timeout=5, keep=2)
    ws.publish(folder, {"w": np.full((4, 3), 4, np.float32)}, step=4, keep=2)
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert names == ["LATEST", "step-000000000003.attempt-0", "step-000000000003.wsindex", "step-000000000004.npz"]
    assert [entry.step for entry in versions.list_versions(folder)] == [3, 4]
    version = next(ws.follow(folder, after=2, timeout=1))
    assert version.step == 4


def test_a_sharded_version_whose_latest_records_a_retried_commits_later_time_reads(tmp_path):
    """A coordinator killed between its index and LATEST, retried, adopts the identical index it
    left; weightstore before readers compared times recorded the retry's time in LATEST, later
    than the index's: those folders read, and a follower serves them. An index written after its
    LATEST record is another commit's: refused."""
    folder = tmp_path / "run"
    for rank in range(2):
        ws.publish_shard(folder, {"w": ws.Piece(np.full((2, 3), rank, np.float32), (2 * rank, 0), (4, 3))},
                         step=1, rank=rank, world=2, attempt=0)
    version = shards.commit_shards(folder, step=1, world=2, attempt=0, timeout=5)
    pointer = json.loads((folder / "LATEST").read_bytes())
    recorded = datetime.datetime.fromisoformat(version.created.replace("Z", "+00:00"))
    for later, reads in ((3, True), (-3, False)):
        moved = recorded + datetime.timedelta(seconds=later)
        created = moved.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        (folder / "LATEST").write_text(json.dumps({**pointer, "created": created}))
        if reads:
            assert ws.load(ws.latest(folder))["w"].tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
            assert next(ws.follow(folder, timeout=1)).step == 1
        else:
            with pytest.raises(ws.FormatError, match="written by another"):
                ws.load(ws.latest(folder))


@pytest.mark.parametrize("word", ["tf-checkpoint", "weightstore-delta"])
def test_a_member_format_no_member_is_written_in_is_refused_before_anything_is_written(tmp_path, word):
    """``format="tf-checkpoint"`` (no suffix) died on a bare IndexError in both calls, and
    ``publish_together`` took any format: it claimed attempt folders, then failed writing a member."""
    for call in (lambda: ws.publish_shard(tmp_path / "run", pieces_of(0), step=1, rank=0, world=1, attempt=0,
                                          format=word),
                 lambda: shards.publish_together(tmp_path / "run", pieces_of(0), step=1, rank=0, world=1, format=word)):
        with pytest.raises(ValueError, match=f"members are safetensors, npz or hdf5 files; format='{word}'"):
            call()
    assert not (tmp_path / "run").exists()


def test_a_corrupt_block_is_refused_naming_the_key(tmp_path):
    folder = tmp_path / "run"
    a = np.arange(600_000, dtype=np.float32).reshape(1000, 600)
    ws.publish_shard(folder, {"w": a}, step=1, rank=0, world=1, attempt=0)
    shards.commit_shards(folder, step=1, world=1, attempt=0, timeout=5)
    member = folder / "step-000000000001.attempt-0" / "rank-00000.safetensors"
    from safetensors.numpy import load_file

    strips = load_file(str(member))  # rows of 2,400 bytes: stored as strips of 64 columns, read alone too
    assert sorted(strips) == sorted(f"w@0,{at}" for at in range(0, 600, 64))
    assert strips["w@0,576"].tobytes() == a[:, 576:].tobytes()
    data = bytearray(member.read_bytes())
    data[-10] ^= 0xFF  # the last block
    member.write_bytes(bytes(data))
    with ws.open(ws.latest(folder)) as store:
        assert store.read_region("w", (slice(0, 100),)).tobytes() == a[:100].tobytes()  # blocks untouched
        with pytest.raises(ws.ChecksumError, match="is corrupt") as caught:
            store.read_region("w", (slice(990, 1000),))
        assert caught.value.key == "w" and caught.value.path.endswith(".wsindex")


V1 = ROOT / "tests" / "data" / "sharded_v1"  # a version committed by weightstore before block tables
V2 = ROOT / "tests" / "data" / "sharded_v2"  # and one of index version 2: block tables read whole
V3 = ROOT / "tests" / "data" / "sharded_v3"  # and one of version 3 whose tables hold BLAKE3 block digests


def hostile_index(tmp_path, edit):
    """An index of version 1 (the committed one in tests/data), edited and resealed."""
    folder = tmp_path / "run"
    shutil.copytree(V1, folder)
    path = folder / "step-000000000001.wsindex"
    raw = json.loads(path.read_text())
    raw.pop("crc32")
    edit(raw)
    path.write_bytes(seal(raw))  # a hostile writer seals what it wrote
    return str(path)


def hostile_v2_index(tmp_path, edit):
    """An index of version 2 (one key, two ranks, as this weightstore commits it), edited and resealed."""
    folder = tmp_path / "run"
    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    for rank in range(2):
        ws.publish_shard(folder, {"w": ws.Piece(a[3 * rank:3 * rank + 3], (3 * rank, 0), (6, 4))},
                         step=1, rank=rank, world=2, attempt=0)
    path = Path(shards.commit_shards(folder, step=1, world=2, attempt=0, timeout=5).path)
    raw = json.loads(path.read_text())
    raw.pop("crc32")
    edit(raw)
    path.write_bytes(seal(raw))
    return str(path)


def test_a_resealed_index_of_a_huge_tensor_is_refused_before_its_array_is_allocated(tmp_path):
    """The index says ``w`` has 2**32 + 6 rows, rank 1's box all but its first 3 (the boxes tile
    it): the reader allocated the 64 GB array (MemoryError) before rank 1's block table, which
    holds no such piece, refused it (found by fuzzing the index's fields, resealed)."""
    def huge(raw):
        raw["tensors"]["w"][1][0] = 2**32 + 6
        layout = raw["layouts"][raw["tensors"]["w"][2]]
        assert layout[1:] == [0, 0, 0, 3, 4, 1, 3, 0, 3, 4]  # ndim, then (member, start, shape) per box
        layout[-2] = 2**32 + 3

    path = hostile_v2_index(tmp_path, huge)
    result = hostile.run_isolated(
        "try:\n"
        f"    ws.open({path!r})['w']\n"
        "except ws.FormatError as exc:\n"
        "    print('REFUSED', exc.key, exc)\n", address_space=2 << 30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED w" in result.stdout and path in result.stdout and "rank-00001" in result.stdout


def test_a_region_digest_follows_the_rows_it_reads_whichever_columns_changed(tmp_path):
    """A column-striped piece's blocks carry the digest of their band of rows (all columns,
    hashed once from the piece in memory): a region keeps its digest while its rows keep their
    bytes, and loses it when any byte of those rows changes, in its columns or not."""
    folder = tmp_path / "run"
    w = np.random.default_rng(0).standard_normal((256, 1024), dtype=np.float32)
    changed = w.copy()
    changed[200, 1000] += 1  # a row of the bottom half, a column outside the left half
    digests = []
    for step, value in ((1, w), (2, changed)):
        ws.publish_shard(folder, {"w": value}, step=step, rank=0, world=1, attempt=0)
        version = shards.commit_shards(folder, step=step, world=1, attempt=0, timeout=5, keep=None)
        with ws.open(version) as store:
            assert len(store._reader.placed("w")) > 1  # stored as column strips
            digests.append([store.region_digest("w", region) for region in
                            ((slice(0, 64),), (slice(192, 256), slice(0, 512)), (slice(192, 256), slice(992, 1024)))])
            assert store.read_region("w", (slice(192, 256), slice(0, 512))).tobytes() == value[192:, :512].tobytes()
    assert digests[0][0] == digests[1][0]  # rows untouched
    assert digests[0][1] != digests[1][1]  # its rows changed, in other columns
    assert digests[0][2] != digests[1][2]  # its rows and columns changed


def test_a_block_changed_to_keep_its_crc32_changes_the_digest_of_its_rows(tmp_path):
    """Block digests are change digests made of CRCs (each band's CRC-64 beside its blocks'
    CRC-32s, not a hash of the bytes): a block changed so that its CRC-32 stays the same (a
    forged collision) still changes the digest of every region that holds its rows, and of no
    other rows."""
    from crc_forge import forge_crc32_collision

    folder = tmp_path / "run"
    w = np.random.default_rng(1).standard_normal((256, 1024), dtype=np.float32)
    ws.publish_shard(folder, {"w": w}, step=1, rank=0, world=1, attempt=0)
    first = shards.commit_shards(folder, step=1, world=1, attempt=0, timeout=5, keep=None)
    with ws.open(first) as store:
        strip = store._reader.placed("w")[0]
    rows, columns = strip.rows, strip.shape[1]
    changed = w.copy()
    block = np.ascontiguousarray(w[rows:2 * rows, :columns])  # the first strip's second block
    changed[rows:2 * rows, :columns] = forge_crc32_collision(block, block.flat[0] + 1).reshape(block.shape)
    ws.publish_shard(folder, {"w": changed}, step=2, rank=0, world=1, attempt=0)
    second = shards.commit_shards(folder, step=2, world=1, attempt=0, timeout=5, keep=None)
    with ws.open(first) as before, ws.open(second) as after:
        assert before._reader.placed("w")[0].crcs == after._reader.placed("w")[0].crcs  # blind to it
        for region, same in (((slice(0, rows),), True), ((slice(rows, 2 * rows), slice(512, 1024)), False),
                             ((),  False)):
            old, new = before.region_digest("w", region), after.region_digest("w", region)
            assert new.startswith("change:") and (old == new) is same, region
        assert after.read_region("w", (slice(rows, 2 * rows),)).tobytes() == changed[rows:2 * rows].tobytes()


def test_a_writer_whose_isal_has_no_crc64_hashes_its_bands_with_blake3_as_before(tmp_path, monkeypatch):
    """Where ISA-L's CRC-64 is not available the rank writes BLAKE3 band digests (a table with no
    ``digest`` kind, as before): regions still carry digests, ``blake3:``, equal while the
    bytes are and changing with them."""
    from weightstore.core import checksums

    monkeypatch.setattr(checksums, "crc64", lambda view: None)
    folder = tmp_path / "run"
    w = np.random.default_rng(2).standard_normal((256, 1024), dtype=np.float32)
    found = []
    for step, value in ((1, w), (2, w), (3, w + 1)):
        ws.publish_shard(folder, {"w": value}, step=step, rank=0, world=1, attempt=0)
        with ws.open(shards.commit_shards(folder, step=step, world=1, attempt=0, timeout=5, keep=None)) as store:
            found.append(store.region_digest("w", (slice(0, 64),)))
            assert store.read_region("w", (slice(0, 64),)).tobytes() == value[:64].tobytes()
    assert found[0].startswith("blake3:") and found[0] == found[1] != found[2]


def test_replicas_hashed_with_and_without_crc64_are_refused_as_of_two_kinds_not_as_diverged(tmp_path, monkeypatch):
    """Replicas of a part with equal bytes, one from a rank whose ISA-L has no CRC-64 (BLAKE3
    band digests), cannot be told alike by their digests: the commit refuses them saying so and
    what to make alike, never that their values diverged; replicas written alike that way
    commit as ever."""
    from weightstore.core import checksums

    a = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
    crc64 = checksums.crc64
    for rank in range(2):
        monkeypatch.setattr(checksums, "crc64", crc64 if rank == 0 else (lambda view: None))
        ws.publish_shard(tmp_path / "mixed", {"w": a}, step=1, rank=rank, world=2, attempt=0)
    with pytest.raises(ws.PublishError, match=r"ranks 0 and 1 wrote the part at \[0, 0\], one with change digests "
                       r"and one with BLAKE3 ones.*isal.*digests=False") as caught:
        shards.commit_shards(tmp_path / "mixed", step=1, world=2, attempt=0, timeout=5)
    assert caught.value.key == "w" and "diverged" not in str(caught.value)
    for rank in range(2):  # both without CRC-64: alike
        ws.publish_shard(tmp_path / "alike", {"w": a}, step=1, rank=rank, world=2, attempt=0)
    assert np.array_equal(ws.load(shards.commit_shards(tmp_path / "alike", step=1, world=2, attempt=0, timeout=5))["w"], a)


def test_change_digests_never_equal_the_blake3_digests_of_an_older_writer_and_diff_reads_them(tmp_path):
    """A table written before change digests (``tests/data/sharded_v3``, by the weightstore
    before them) holds BLAKE3 of each band's bytes and reads as ever; its regions' digests
    (``blake3:``) never equal this writer's (``change:``) of the same bytes, so a follower reads
    a region again once rather than comparing digests of two kinds. ``ws diff`` compares two
    versions that may have different authors, against whom a CRC-made digest proves nothing: it
    reads the pairs whose change digests agree instead of calling them equal unread. Nor does a
    version of another folder ever have the same change digests (hot reload from two folders)."""
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    folder = tmp_path / "run"
    shutil.copytree(V3, folder)
    w = np.arange(24, dtype=np.float32).reshape(6, 4)
    s = (np.arange(256 * 512) % 251).astype(np.float16).reshape(256, 512)
    versions_ = {1: ws.latest(folder)}
    with ws.open(versions_[1]) as store:
        assert store._reader.index.version == 3 and store["w"].tobytes() == w.tobytes()
        assert store.read_region("s", (slice(10, 200), slice(100, 300))).tobytes() == s[10:200, 100:300].tobytes()
        assert store.region_digest("s", (slice(0, 8),)).startswith("blake3:")
    for step in (2, 3):  # the same bytes as the old version's, twice
        for rank in range(2):
            ws.publish_shard(folder, {"w": ws.Piece(w[3 * rank:3 * rank + 3], (3 * rank, 0), (6, 4))},
                             step=step, rank=rank, world=2, attempt=0)
        versions_[step] = shards.commit_shards(folder, step=step, world=2, attempt=0, timeout=5, keep=None)
    digests = {}
    for step, version in versions_.items():
        with ws.open(version) as store:
            digests[step] = store.region_digest("w", (slice(1, 5),))
    assert digests[1].startswith("blake3:") and digests[2].startswith("change:")
    assert digests[1] != digests[2] == digests[3]
    shutil.copytree(folder, tmp_path / "copy")  # another folder, perhaps of another author: never matches
    with ws.open(str(tmp_path / "copy" / Path(versions_[3].path).name)) as store:
        assert store.region_digest("w", (slice(1, 5),)) not in (None, digests[3])
    diff = CliRunner().invoke(app, ["diff", versions_[2].path, versions_[3].path, "--json"])
    assert diff.exit_code == 0, diff.output
    found = json.loads(diff.output)
    assert found["equal"] and found["unchanged"] == 1 and found["unchanged_by_digest"] == 0


def test_change_digests_are_bound_to_where_the_folder_is_not_the_name_that_reached_it(tmp_path, monkeypatch):
    """Change digests are trusted between versions of one folder only (another author could
    choose 12 bytes to keep a band's CRCs): two folders reached by one relative name from two
    working folders never share a region digest, as a follower with ``skip_unchanged`` would
    keep one's bytes for the other's; one folder reached by its relative name, its absolute
    name and a link to it has one."""
    from crc_forge import forge_crc32_crc64_collision

    a = np.random.default_rng(4).standard_normal(256).astype(np.float32)  # one block, one band
    forged = forge_crc32_crc64_collision(a, 5.0)  # other bytes, the same CRC-32 and CRC-64
    for author, value in (("a", a), ("b", forged)):
        ws.publish_shard(tmp_path / author / "run", {"w": value}, step=1, rank=0, world=1, attempt=0)
        shards.commit_shards(tmp_path / author / "run", step=1, world=1, attempt=0, timeout=5, keep=None)
    name = "run/step-000000000001.wsindex"
    (tmp_path / "link").symlink_to(tmp_path / "b" / "run")
    digests = {}
    for author in ("a", "b"):
        monkeypatch.chdir(tmp_path / author)
        with ws.open(name) as store:
            digests[author] = store.region_digest("w", ())
            assert store["w"].tobytes() == (a if author == "a" else forged).tobytes()
    assert digests["a"].startswith("change:") and digests["a"] != digests["b"]
    for other in (tmp_path / "b" / name, tmp_path / "link" / "step-000000000001.wsindex"):
        with ws.open(other) as store:
            assert store.region_digest("w", ()) == digests["b"]


def test_ws_diff_reads_sharded_versions_whose_block_digests_agree_of_either_kind(tmp_path, monkeypatch):
    """A block table's BLAKE3 band digests (a rank whose ISA-L has no CRC-64, a table written
    before change digests) are its author's word too: no read or ``ws verify`` checks them
    against the bytes. ``ws diff`` of two versions whose authors may differ reads every pair of
    a sharded version, so an author who claims another's band digests for other bytes is told
    apart (exit 1), where the digests made them equal unread."""
    from weightstore.core import checksums

    a = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    monkeypatch.setattr(checksums, "crc64", lambda view: None)  # BLAKE3 band digests: blake3: regions
    band_digests = shards.band_digests
    for author, value in (("a", a), ("b", a + 1)):
        if author == "b":  # claims a's bands for its own bytes
            monkeypatch.setattr(shards, "band_digests", lambda piece, rows: band_digests(a, rows))
        ws.publish_shard(tmp_path / author, {"w": value}, step=1, rank=0, world=1, attempt=0)
        shards.commit_shards(tmp_path / author, step=1, world=1, attempt=0, timeout=5, keep=None)
    paths = [str(tmp_path / author / "step-000000000001.wsindex") for author in "ab"]
    with ws.open(paths[0]) as left, ws.open(paths[1]) as right:
        assert left.region_digest("w", ()).startswith("blake3:")
        assert left.region_digest("w", ()) == right.region_digest("w", ()) and not np.array_equal(left["w"], right["w"])
    found = subprocess.run([sys.executable, "-m", "weightstore", "diff", *paths, "--json"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert found.returncode == 1, found.stderr
    result = json.loads(found.stdout)
    assert not result["equal"] and result["unchanged_by_digest"] == 0 and result["changed"][0]["key"] == "w"


@pytest.mark.parametrize("fmt", ["safetensors", "npz", "hdf5"])
def test_a_member_read_alone_verifies_the_crcs_its_writer_joined_from_its_blocks(tmp_path, fmt):
    """Each stored tensor's CRC-32 in a member's own manifest is joined from its block CRC-32s,
    not taken in a pass of the write: read alone, every tensor verifies (streamed and held, strips,
    a size no multiple of 8, a scalar, an empty one), and a flipped byte is caught."""
    rng = np.random.default_rng(11)
    pieces = {"long": rng.standard_normal(1_300_000).astype(np.float32),  # 5.2 MB stored whole: past every write chunk
              "wide": rng.standard_normal((300, 1100)).astype(np.float32),  # column strips
              "odd": rng.integers(0, 255, 7, dtype=np.uint8), "scalar": np.float64(3.5), "empty": np.zeros((0, 3))}
    ws.publish_shard(tmp_path, pieces, step=1, rank=0, world=1, attempt=0, format=fmt)
    member = tmp_path / "step-000000000001.attempt-0" / f"rank-00000.{'h5' if fmt == 'hdf5' else fmt}"
    with ws.open(member) as alone:
        assert sorted({alone.metadata[shards.SHARD_METADATA]["pieces"][name]["key"] for name in alone}) == sorted(
            pieces)
        for name in alone:
            alone[name]  # verified against the CRC-32 its manifest records
    assert np.array_equal(ws.load(shards.commit_shards(tmp_path, step=1, world=1, attempt=0, timeout=5))["long"],
                          pieces["long"])
    data = bytearray(member.read_bytes())
    data[data.find(pieces["long"][1000:1016].tobytes()) + 3] ^= 0xFF
    member.write_bytes(bytes(data))
    with ws.open(member) as alone, pytest.raises(ws.ChecksumError) as caught:
        alone["long"]
    assert caught.value.key == "long" and caught.value.path == str(member)


def test_a_member_published_without_digests_reads_verified_and_its_regions_have_no_digest(tmp_path):
    """``digests=False`` (a checkpoint no follower reads) skips the BLAKE3 of every block: its
    member's table holds CRC-32s only, every block is still verified as it is read, its
    regions have no digest (a follower reads them again, never trusting a CRC-32), a member
    with digests beside it keeps its own, and replicas are told alike or diverged by their
    blocks' CRC-32s."""
    folder = tmp_path / "run"
    w = np.random.default_rng(0).standard_normal((256, 1024), dtype=np.float32)
    for rank in range(2):
        ws.publish_shard(folder, {"w": ws.Piece(w[128 * rank:128 * (rank + 1)], (128 * rank, 0), w.shape)}, step=1,
                         rank=rank, world=2, attempt=0, digests=rank == 0)
    version = shards.commit_shards(folder, step=1, world=2, attempt=0, timeout=5)
    members = folder / "step-000000000001.attempt-0"
    with ws.open(version) as store:
        assert len(store._reader.placed("w")) > 2  # column strips
        assert store.read_region("w", ()).tobytes() == w.tobytes()
        assert store.region_digest("w", (slice(0, 128),)) is not None
        assert store.region_digest("w", (slice(100, 200),)) is None and store.region_digest("w", ()) is None
    tables = [(members / f"rank-0000{rank}.blocks").stat().st_size for rank in range(2)]
    assert tables[0] - tables[1] > 32 * 64  # a BLAKE3 digest per block, in rank 0's table only
    member = members / "rank-00001.safetensors"
    data = bytearray(member.read_bytes())
    data[-10] ^= 0xFF  # the last block of rank 1's last strip
    member.write_bytes(bytes(data))
    with ws.open(version) as store:
        with pytest.raises(ws.ChecksumError, match="rank-00001.safetensors is corrupt") as caught:
            store.read_region("w", (slice(250, 256),))
        assert caught.value.key == "w" and caught.value.path.endswith(".wsindex")
    for name, values in (("same", (w, w)), ("diverged", (w, w + 1))):
        for rank, value in enumerate(values):
            ws.publish_shard(tmp_path / name, {"w": value}, step=1, rank=rank, world=2, attempt=0, digests=False)
    version = shards.commit_shards(tmp_path / "same", step=1, world=2, attempt=0, timeout=5)
    assert np.array_equal(ws.load(version)["w"], w)
    with pytest.raises(ws.PublishError, match=r"ranks 0 and 1 wrote the part at \[0, 0\] with different values"):
        shards.commit_shards(tmp_path / "diverged", step=1, world=2, attempt=0, timeout=5)
    version = shards.publish_together(tmp_path / "together", {"w": w}, step=1, rank=0, world=1, digests=False)
    with ws.open(version) as store:
        assert store.read_region("w", ()).tobytes() == w.tobytes() and store.region_digest("w", ()) is None


def test_an_index_of_version_2_still_reads(tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(V2, folder)
    w = np.arange(24, dtype=np.float32).reshape(6, 4)
    s = (np.arange(256 * 512) % 251).astype(np.float16).reshape(256, 512)
    version = ws.latest(folder)
    assert version.metadata == {"made": "weightstore sharded index v2"}
    with ws.open(version) as store:
        assert store._reader.index.version == 2
        assert store["w"].tobytes() == w.tobytes() and store["s"].tobytes() == s.tobytes()
        assert store.read_region("s", (slice(10, 200), slice(100, 300))).tobytes() == s[10:200, 100:300].tobytes()
        assert store.read_region("w", (slice(2, 5),)).tobytes() == w[2:5].tobytes()
        assert store.region_digest("s", (slice(0, 8),)) == store.region_digest("s", (slice(0, 8),)) is not None
    for rank in range(2):  # a version of this weightstore after it in the same folder
        ws.publish_shard(folder, {"w": ws.Piece(w[3 * rank:3 * rank + 3] + 1, (3 * rank, 0), (6, 4))},
                         step=2, rank=rank, world=2, attempt=0)
    shards.commit_shards(folder, step=2, world=2, attempt=0, timeout=5, keep=None)
    assert ws.load(ws.latest(folder))["w"].tobytes() == (w + 1).tobytes()
    assert ws.load(version)["s"].tobytes() == s.tobytes()


def test_an_unfinished_attempt_of_an_older_writer_is_refused_naming_its_done_record_and_then_cleaned(tmp_path):
    """Done-records of version 1 (before block tables) left in an attempt no index names: its
    commit is refused naming the lowest rank's record (whatever order the file system lists them
    in) and what to do; the step's next attempt commits and removes it."""
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copytree(V1 / "step-000000000001.attempt-0", folder / "step-000000000001.attempt-0")
    with pytest.raises(ws.FormatError, match="done-record of version 1.*publish the step again") as caught:
        shards.commit_shards(folder, step=1, world=2, attempt=0, timeout=5)
    assert caught.value.path.endswith("step-000000000001.attempt-0/rank-00000.done")
    w = np.arange(24, dtype=np.float32).reshape(6, 4)
    for rank in range(2):
        ws.publish_shard(folder, {"w": ws.Piece(w[3 * rank:3 * rank + 3], (3 * rank, 0), (6, 4))},
                         step=1, rank=rank, world=2, attempt=1)
    shards.commit_shards(folder, step=1, world=2, attempt=1, timeout=5)
    assert ws.load(ws.latest(folder))["w"].tobytes() == w.tobytes()
    assert not (folder / "step-000000000001.attempt-0").exists()


def test_an_index_of_version_1_still_reads(tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(V1, folder)
    w = np.arange(24, dtype=np.float32).reshape(6, 4)
    s = (np.arange(256 * 512) % 251).astype(np.float16).reshape(256, 512)
    version = ws.latest(folder)
    assert version.metadata == {"made": "weightstore sharded index v1"}
    with ws.open(version) as store:
        assert store["w"].tobytes() == w.tobytes() and store["s"].tobytes() == s.tobytes()
        assert store.read_region("s", (slice(10, 200), slice(100, 300))).tobytes() == s[10:200, 100:300].tobytes()
        assert store.region_digest("s", (slice(0, 8),)) == store.region_digest("s", (slice(0, 8),)) is not None
    assert [entry.step for entry in versions.list_versions(folder)] == [1]
    for rank in range(2):  # a version 2 after it in the same folder
        ws.publish_shard(folder, {"w": ws.Piece(w[3 * rank:3 * rank + 3] + 1, (3 * rank, 0), (6, 4))},
                         step=2, rank=rank, world=2, attempt=0)
    shards.commit_shards(folder, step=2, world=2, attempt=0, timeout=5, keep=None)
    assert ws.load(ws.latest(folder))["w"].tobytes() == (w + 1).tobytes()
    assert ws.load(version)["s"].tobytes() == s.tobytes()


@pytest.mark.parametrize("edit, words", [
    (lambda raw: raw["tensors"]["w"]["pieces"][1].update(offset=10 ** 9), "past the end of member"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1].update(start=[2, 0]), "overlap"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1].update(crcs=[1, 2]), "block checksums"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1].update(crcs=[]), "0 block checksums for 1 blocks"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1].update(blake3=[]), "0 block digests for 1 blocks"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1]["blake3"].append("0" * 64), "2 block digests for 1 blocks"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1]["blake3"].__setitem__(0, "0" * 63), "hex digests"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1]["blake3"].__setitem__(0, "A" * 64), "hex digests"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1].update(blake3="0" * 64), "hex digests"),
    (lambda raw: raw["tensors"]["w"].update(shape=[7, 4]), "do not cover"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1].update(member=5), "member 5"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1].update(member=0, offset=1700), "overlap another's in member"),
    (lambda raw: raw["tensors"]["w"]["pieces"].extend([raw["tensors"]["w"]["pieces"][0]] * 20000), "pieces, over"),
    (lambda raw: raw["tensors"]["w"].update(dtype="object"), "unknown dtype"),
    (lambda raw: raw["tensors"]["w"]["pieces"][1].update(start=[2 ** 63, 0]), "below 2\\*\\*62"),
])
def test_a_hostile_index_is_refused_naming_file_and_key(tmp_path, edit, words):
    path = hostile_index(tmp_path, edit)
    with pytest.raises(ws.FormatError, match=words) as caught:
        ws.open(path)
    assert caught.value.path == path and caught.value.key == "w"


def test_the_overlap_check_of_an_index_does_bounded_work(tmp_path, monkeypatch):
    """Pieces split along two axes at most are swept, so 16,384 pieces sharing their rows are no
    134 million comparisons; pieces split along three are compared pairwise along the axis that
    separates them best, and one index may ask a bounded number of comparisons in all (a floor,
    or a number per byte of the index), so a hostile index repeating an expensive layout is
    refused instead of worked through for minutes."""
    from weightstore.formats import _sharded_index as shardindex

    n = limits.MAX_PIECES_PER_KEY
    strips = hostile_index(tmp_path / "strips", lambda raw: raw["tensors"].update(s={
        "dtype": "float32", "shape": [1, n], "pieces": [
            {**raw["tensors"]["w"]["pieces"][0], "start": [0, i], "shape": [1, 1], "offset": 0, "rows": 1,
             "crcs": [0], "blake3": ["0" * 64]} for i in range(n)]}))
    with pytest.raises(ws.FormatError, match="overlap another's in member") as caught:  # all at offset 0, but no
        ws.open(strips)                                                                  # pieces overlap in the tensor
    assert caught.value.key == "s"

    def grid(raw, keys):  # each key a 2 x 2 x 2 grid of parts: 12 pairs to compare along any axis
        first = raw["tensors"]["w"]["pieces"][0]
        for key in keys:
            raw["tensors"][key] = {"dtype": "float32", "shape": [2, 2, 2], "pieces": [
                {**first, "start": [r, c, z], "shape": [1, 1, 1], "crcs": [0], "blake3": ["0" * 64]}
                for r in (0, 1) for c in (0, 1) for z in (0, 1)]}

    # pieces split along two axes or fewer are swept (no pairs); along three, pairs are budgeted
    monkeypatch.setattr(shardindex, "OVERLAP_PAIRS", 12)
    monkeypatch.setattr(shardindex, "OVERLAP_PAIRS_PER_BYTE", 0)
    with pytest.raises(ws.FormatError, match="overlap another's in member"):  # one grid: within the budget
        ws.open(hostile_index(tmp_path / "one", lambda raw: grid(raw, ["g"])))
    with pytest.raises(ws.FormatError, match="interleave along three axes or more") as caught:  # two: past it
        ws.open(hostile_index(tmp_path / "two", lambda raw: grid(raw, ["g", "h"])))
    assert caught.value.key == "h"


def test_a_version_2_layout_is_swept_and_budgeted_as_version_1_pieces_are(tmp_path, monkeypatch):
    """A version 2 index names boxes in layouts, not pieces: boxes split along at most two axes
    are swept in n log n (a staircase of 8,192 passes, one overlapping box is found), and boxes
    split along three are compared within the budget, spent across the index's layouts."""
    from weightstore.formats import _sharded_index as shardindex

    def layout(boxes):
        ndim = len(boxes[0][1])
        return [ndim, *(v for member, start, shape in boxes for v in (member, *start, *shape))]

    def keyed(raw, layouts, shapes):
        raw["layouts"] = [layout(boxes) for boxes in layouts]
        raw["tensors"] = {f"k{at}": ["float32", shape, at] for at, shape in enumerate(shapes)}

    n = 8192
    stairs = [(i % 2, [i, i], [1, n - i]) for i in range(n)] + [(i % 2, [i + 1, i], [n - i - 1, 1])
                                                               for i in range(n - 1)]
    monkeypatch.setattr(shardindex, "OVERLAP_PAIRS", 12)  # none spent on two split axes
    monkeypatch.setattr(shardindex, "OVERLAP_PAIRS_PER_BYTE", 0)
    path = hostile_v2_index(tmp_path / "stairs", lambda raw: keyed(raw, [stairs], [[n, n]]))
    index = ShardIndex.parse(Path(path).read_bytes())
    assert index.version == 3 and len(index.tensors["k0"].layout) == len(stairs)
    overlapping = [*stairs[:-1], (1, [n - 2, n - 3], [2, 1])]
    with pytest.raises(ws.FormatError, match="has pieces that overlap") as caught:
        ShardIndex.parse(Path(hostile_v2_index(tmp_path / "over", lambda raw: keyed(raw, [overlapping],
                                                                                    [[n, n]]))).read_bytes())
    assert caught.value.key == "k0"

    grid = [(r, [r, c, z], [1, 1, 1]) for r in (0, 1) for c in (0, 1) for z in (0, 1)]  # 12 pairs
    ShardIndex.parse(Path(hostile_v2_index(tmp_path / "one", lambda raw: keyed(raw, [grid], [[2, 2, 2]])))
                     .read_bytes())
    other = [(1 - member, start, shape) for member, start, shape in grid]  # another layout: checked again
    with pytest.raises(ws.FormatError, match="interleave along three axes or more") as caught:
        ShardIndex.parse(Path(hostile_v2_index(tmp_path / "two", lambda raw: keyed(raw, [grid, other],
                                                                                   [[2, 2, 2]] * 2))).read_bytes())
    assert caught.value.key == "k1"


def test_a_hostile_index_naming_an_empty_tensor_no_array_can_have_is_refused_at_open(tmp_path):
    """(0, 2**61) holds nothing, so no piece need cover it, yet numpy refuses to make it: the
    read would raise numpy's ValueError, not an error naming the file and the key."""
    path = hostile_index(tmp_path, lambda raw: raw["tensors"].update(
        e={"dtype": "float32", "shape": [0, 2 ** 61], "pieces": []}))
    with pytest.raises(ws.FormatError, match="too large for any array") as caught:
        ws.open(path)
    assert caught.value.path == path and caught.value.key == "e"


def test_a_hostile_index_cannot_name_files_outside_its_attempt(tmp_path):
    path = hostile_index(tmp_path, lambda raw: raw["members"][0].update(file="../../etc/passwd"))
    with pytest.raises(ws.FormatError, match="member 0 must be") as caught:
        ws.open(path)
    assert caught.value.path == path
    with pytest.raises(ws.FormatError, match="not a weightstore-sharded file"):
        ShardIndex.parse(seal({"format": "weightstore-latest"}))
    data = bytearray(Path(path).read_bytes())
    data[data.index(b'"offset":') + 9] ^= 1  # one digit of an offset, not resealed
    Path(path).write_bytes(bytes(data))
    with pytest.raises(ws.FormatError, match="CRC-32 does not match"):
        ws.open(path)


def test_bfloat16_regions_keep_their_dtype(tmp_path):
    folder = tmp_path / "run"
    a = np.random.default_rng(1).standard_normal((8, 5)).astype(ml_dtypes.bfloat16)
    ws.publish_shard(folder, {"e": ws.Piece(a[:, :2], (0, 0), (8, 5))}, step=1, rank=0, world=2, attempt=0)
    ws.publish_shard(folder, {"e": ws.Piece(a[:, 2:], (0, 2), (8, 5))}, step=1, rank=1, world=2, attempt=0)
    version = shards.commit_shards(folder, step=1, world=2, attempt=0, timeout=5)
    part = ws.open(version).read_region("e", (slice(1, 7), slice(1, 4)))
    assert part.dtype == a.dtype and part.tobytes() == a[1:7, 1:4].tobytes()


def test_the_cli_lists_verifies_exports_and_cleans_a_sharded_version(tmp_path):
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    def run(*args):
        return CliRunner().invoke(app, [str(a) for a in args])

    folder = tmp_path / "run"
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=0)
    version = shards.commit_shards(folder, step=2, world=4, attempt=0, timeout=5)
    listed = run("versions", folder, "--json")
    assert listed.exit_code == 0, listed.output
    entry = json.loads(listed.output)["versions"][0]
    members = sorted((folder / "step-000000000002.attempt-0").glob("*.safetensors"))
    assert entry["members"] == 4 and entry["member_bytes"] == sum(p.stat().st_size for p in members)
    assert "4 members" in run("versions", folder).output
    ls = run("ls", version.path, "--json")
    assert {t["key"]: t["shape"] for t in json.loads(ls.output)["tensors"]}["dense/kernel"] == [96, 2048]
    assert run("verify", version.path).exit_code == 0
    whole = tmp_path / "whole.safetensors"
    assert run("export", version.path, "-o", whole).exit_code == 0
    from safetensors.numpy import load_file

    assert load_file(str(whole))["dense/kernel"].tobytes() == model()["dense/kernel"].tobytes()
    data = bytearray(members[1].read_bytes())
    data[-100] ^= 1
    members[1].write_bytes(bytes(data))
    assert run("verify", version.path).exit_code == 1
    (folder / "step-000000000001.attempt-0").mkdir()  # a dead attempt of an older step
    (folder / "step-000000000003.attempt-2").mkdir()  # and one of a commit that never came
    cleaned = run("clean", folder, "--json")
    assert sorted(json.loads(cleaned.output)["removed"]) == ["step-000000000001.attempt-0",
                                                             "step-000000000003.attempt-2"]
    assert (folder / "step-000000000002.wsindex").exists() and (folder / "step-000000000002.attempt-0").is_dir()


@pytest.mark.parametrize("step", [2, 1_733_150_000_000])  # a millisecond timestamp: a step of 13 digits
def test_clean_keeps_every_committed_version_when_latest_is_missing(tmp_path, step):
    """A folder whose LATEST was deleted: the newest version counts as current, as for the next
    publish, so clean removes dead attempts only, never committed versions and their members."""
    folder = tmp_path / "run"
    ws.publish(folder, {"w": np.ones(2, np.float32)}, step=1)
    for offset in (0, 1):
        for rank in range(4):
            ws.publish_shard(folder, pieces_of(rank), step=step + offset, rank=rank, world=4, attempt=1)
        shards.commit_shards(folder, step=step + offset, world=4, attempt=1, timeout=5)
    (folder / "LATEST").unlink()
    dead = folder / f"step-{step + 1:012d}.attempt-0"
    dead.mkdir()  # an attempt of the newest step that never committed
    assert shards.next_attempt(folder, step + 1) == 2
    assert shards.clean_folder(folder) == [dead.name]
    for committed in (step, step + 1):
        assert ws.load(folder / f"step-{committed:012d}.wsindex")["dense/kernel"].tobytes() == \
            model()["dense/kernel"].tobytes()


def test_a_missing_member_is_named_and_is_no_pruned_version(tmp_path):
    folder = tmp_path / "run"
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=0)
    version = shards.commit_shards(folder, step=2, world=4, attempt=0, timeout=5)
    (folder / "step-000000000002.attempt-0" / "rank-00001.safetensors").unlink()
    for opening in (lambda: ws.open(version.path), lambda: ws.load(ws.latest(folder))):
        with pytest.raises(ws.StoreNotFoundError, match="member step-000000000002.attempt-0/rank-00001.safetensors "
                                                        "that the index names is missing") as caught:
            opening()
        assert caught.value.path == version.path and not isinstance(caught.value, ws.VersionGoneError)


def test_read_region_and_load_regions_on_a_plain_store(tmp_path):
    path = tmp_path / "m.npz"
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    ws.save(path, {"a": a, "b": np.zeros(2)})
    with ws.open(path) as store:
        assert store.read_region("a", (slice(1, 3), slice(2, 5))).tobytes() == a[1:3, 2:5].tobytes()
        with pytest.raises(ws.TargetError, match="has a step; regions are contiguous"):
            store.read_region("a", (slice(0, 4, 2),))
    assert ws.load(path, regions={"a": (slice(3, None),)})["a"].tobytes() == a[3:].tobytes()
    with pytest.raises(ws.KeyNotInStoreError):
        ws.load(path, regions={"c": (slice(0, 1),)})


def test_every_reader_refuses_a_region_outside_the_tensor_rather_than_clamping_it(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    ws.save(tmp_path / "m.npz", {"a": a})
    ws.publish_shard(tmp_path / "run", {"a": a}, step=1, rank=0, world=1, attempt=0)
    for path in (tmp_path / "m.npz", shards.commit_shards(tmp_path / "run", step=1, world=1, attempt=0, timeout=5)):
        with ws.open(path) as store:
            with pytest.raises(ws.TargetError, match=r"tensor 'a': .* reaches outside the tensor's shape \[4, 6\]"):
                store.read_region("a", (slice(20, 30),))  # not 0 rows, as numpy would give
            with pytest.raises(ws.TargetError, match=r"reaches outside .* \(axis 1 has 6\)"):
                store.read_region("a", (slice(None), slice(-7, None)))
            with pytest.raises(ws.TargetError, match="bounds that are not integers"):
                store.read_region("a", (slice(0.5, 2),))
            assert store.read_region("a", (slice(-1, None), slice(0, 0))).shape == (1, 0)  # inside, and empty


def test_a_member_that_is_not_what_its_done_record_says_is_refused(tmp_path):
    folder = tmp_path / "run"
    ws.publish_shard(folder, {"w": np.zeros((4, 3), np.float32)}, step=1, rank=0, world=1, attempt=0)
    member = folder / "step-000000000001.attempt-0" / "rank-00000.safetensors"
    member.write_bytes(member.read_bytes()[:-8])  # truncated behind the writer's back
    with pytest.raises(ws.PublishError, match=r"rank-00000.safetensors is \d+ bytes; its done-record says"):
        shards.commit_shards(folder, step=1, world=1, attempt=0, timeout=5)
    member.unlink()
    with pytest.raises(ws.PublishError, match="rank-00000.safetensors is missing; its done-record says"):
        shards.commit_shards(folder, step=1, world=1, attempt=0, timeout=5)
    assert ws.latest(folder) is None


@pytest.mark.parametrize("digests", [True, False])
def test_a_block_table_that_is_not_what_its_done_record_says_is_refused(tmp_path, digests):
    """Readers refuse a version whose table is missing, cut or not a file: the commit, which
    has the table's size in the listing it already made, refuses to publish one (a table without
    digests too, whose CRC-32s only its header counts: its done-record gives their bytes)."""
    folder = tmp_path / "run"
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(rank), step=1, rank=rank, world=4, attempt=0, digests=digests)
    table = folder / "step-000000000001.attempt-0" / "rank-00001.blocks"
    whole = table.read_bytes()
    table.write_bytes(whole[:-8])  # cut behind the writer's back
    with pytest.raises(ws.PublishError, match=r"rank 1's block table rank-00001.blocks is \d+ bytes; its done-record "
                                              rf"says {len(whole)}") as caught:
        shards.commit_shards(folder, step=1, world=4, attempt=0, timeout=5)
    assert caught.value.path == str(table.parent)
    table.unlink()
    table.mkdir()  # not a file: every reader refuses it
    with pytest.raises(ws.PublishError, match="rank 1's block table rank-00001.blocks is missing"):
        shards.commit_shards(folder, step=1, world=4, attempt=0, timeout=5)
    assert ws.latest(folder) is None
    table.rmdir()
    table.write_bytes(whole)
    version = shards.commit_shards(folder, step=1, world=4, attempt=0, timeout=5)
    assert ws.load(version)["dense/kernel"].tobytes() == model()["dense/kernel"].tobytes()


def _four_ranks_publish(folder, *steps, **commit):
    """Each of ``steps`` published by four ranks and committed (``commit``: commit_shards's words)."""
    for step in steps:
        for rank in range(4):
            ws.publish_shard(folder, pieces_of(rank), step=step, rank=rank, world=4, attempt=0)
        shards.commit_shards(folder, step=step, world=4, attempt=0, timeout=5, **commit)


def test_an_index_that_is_a_symbolic_link_keeps_its_members_through_commits_and_ws_clean(tmp_path):
    """Readers follow an index that is a symbolic link (a version linked in from elsewhere); the
    listing of plain files leaves it out. Its members were taken for a dead attempt: the next
    commit and ``ws clean`` removed them, and the version LATEST's neighbour named broke."""
    folder, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _four_ranks_publish(folder, 1, 2)
    for step in (1, 2):
        index = folder / f"step-{step:012d}.wsindex"
        index.rename(elsewhere / index.name)
        index.symlink_to(elsewhere / index.name)
    _four_ranks_publish(folder, 3, keep=None)
    cleaned = subprocess.run([sys.executable, "-m", "weightstore", "clean", str(folder)], capture_output=True,
                             text=True, timeout=120)
    assert cleaned.returncode == 0, cleaned.stderr
    for step in (1, 2, 3):
        assert ws.load(folder / f"step-{step:012d}.wsindex")["dense/kernel"].tobytes() == \
            model()["dense/kernel"].tobytes()


def test_ws_clean_keeps_a_version_whose_member_is_a_symbolic_link(tmp_path):
    """Readers follow a member that is a symbolic link; ``ws clean`` took it for missing (its
    listing of plain files leaves links out) and removed the version as one whose members are
    gone. A member the listing misses is asked for by name before its index is called dead."""
    folder, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    _four_ranks_publish(folder, 1, 2)
    member = folder / "step-000000000001.attempt-0" / "rank-00002.safetensors"
    member.rename(elsewhere / member.name)
    member.symlink_to(elsewhere / member.name)
    (folder / "step-000000000001.attempt-0" / "rank-00003.safetensors").unlink()  # gone: step 1 is dead
    (folder / "step-000000000002.attempt-0" / "rank-00002.safetensors").rename(elsewhere / "two")
    (folder / "step-000000000002.attempt-0" / "rank-00002.safetensors").symlink_to(elsewhere / "two")
    _four_ranks_publish(folder, 3, keep=None)
    cleaned = subprocess.run([sys.executable, "-m", "weightstore", "clean", str(folder)], capture_output=True,
                             text=True, timeout=120)
    assert cleaned.returncode == 0, cleaned.stderr
    assert not (folder / "step-000000000001.wsindex").exists() and (elsewhere / "rank-00002.safetensors").exists()
    for step in (2, 3):
        assert ws.load(folder / f"step-{step:012d}.wsindex")["dense/kernel"].tobytes() == \
            model()["dense/kernel"].tobytes()


@pytest.mark.parametrize("digests", [True, False])
def test_ws_clean_counts_a_block_table_as_the_commit_does(tmp_path, digests):
    """``ws clean`` counted a block table as its head and digests, where the commit counts its
    paged CRC-32s too (``TableRef.size``): a table cut within its CRC-32s passed for whole. A
    table without digests (only its header counts its CRC-32s) is whole at its head, as at the
    commit: its version is kept."""
    folder = tmp_path / "run"
    w = np.random.default_rng(0).standard_normal((256, 1024), dtype=np.float32)
    for step in (1, 2):
        for rank in range(2):
            ws.publish_shard(folder, {"w": ws.Piece(w[128 * rank:128 * (rank + 1)], (128 * rank, 0), w.shape)},
                             step=step, rank=rank, world=2, attempt=0, digests=digests)
        shards.commit_shards(folder, step=step, world=2, attempt=0, timeout=5)
    table = folder / "step-000000000001.attempt-0" / "rank-00001.blocks"
    blocks = ShardIndex.parse((folder / "step-000000000001.wsindex").read_bytes()).members[1].table.blocks
    if digests:
        table.write_bytes(table.read_bytes()[:-4 * blocks])  # as long as its head and digests: cut all the same
        with ws.open(folder / "step-000000000001.wsindex") as store, \
                pytest.raises(ws.FormatError, match="rank-00001.blocks.*truncated"):
            store.region_digest("w", (slice(128, 256),))  # what a follower reads
    cleaned = subprocess.run([sys.executable, "-m", "weightstore", "clean", str(folder), "--json"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cleaned.returncode == 0, cleaned.stderr
    removed = json.loads(cleaned.stdout)["removed"]
    assert sorted(removed) == (["step-000000000001.attempt-0", "step-000000000001.wsindex"] if digests else [])
    if not digests:
        assert np.array_equal(ws.load(folder / "step-000000000001.wsindex")["w"], w)


def test_a_restart_with_another_world_in_the_same_attempt_is_refused_by_every_rank_whatever_the_timing(tmp_path):
    """A job of 5 ranks wrote attempt 0 of a step and died before its commit; restarted with 3
    ranks and attempt 0 again, its commit succeeded or failed by timing (whether it read a
    rank's old done-record before that rank replaced it). Every rank now refuses, naming the
    old world and saying to use a higher attempt=, and the commit fails at once saying the same;
    a job grown into the same attempt alike. Attempt 1 commits, readers take only the 3 members
    the index names, and the commit removes attempt 0."""
    folder = tmp_path / "run"
    w = np.arange(120 * 16, dtype=np.float32).reshape(120, 16)

    def publish(rank: int, world: int, attempt: int) -> None:
        rows = 120 // world
        ws.publish_shard(folder, {"w": ws.Piece(w[rank * rows:(rank + 1) * rows] + world, (rank * rows, 0), w.shape)},
                         step=1, rank=rank, world=world, attempt=attempt)

    for rank in range(5):
        publish(rank, 5, 0)
    for world in (3, 6):
        for rank in range(3):
            with pytest.raises(ws.PublishError, match=rf"holds this rank's done-record of a launch of 5 ranks, and "
                                                      rf"this rank is {rank} of {world}; attempts must increase: "
                                                      r"publish the step again with a higher attempt="):
                publish(rank, world, 0)
    for world in (3, 6):
        with pytest.raises(ws.PublishError, match=rf"rank \d of 5, not step 1 attempt 0 of {world} \(ranks or a launch "
                                                  r"of another world wrote it; attempts must increase"):
            shards.commit_shards(folder, step=1, world=world, attempt=0, timeout=60)
    assert ws.latest(folder) is None
    for rank in range(3):
        publish(rank, 3, 1)
    version = shards.commit_shards(folder, step=1, world=3, attempt=1, timeout=5)
    assert [member.rank for member in ShardIndex.parse(Path(version.path).read_bytes()).members] == [0, 1, 2]
    with ws.open(version) as store:
        assert store.read_region("w", (slice(90, 120),)).tobytes() == (w[90:] + 3).tobytes()
    assert not (folder / "step-000000000001.attempt-0").exists()
    attempt = folder / "step-000000000001.attempt-1"
    named = sorted(f"rank-0000{rank}{suffix}" for rank in range(3) for suffix in (".safetensors", ".blocks", ".done"))
    assert sorted(p.name for p in attempt.iterdir()) == named
    # rank files past the world (a larger launch whose lower ranks never wrote) or of another form, as an older
    # weightstore left them: ws clean removes them (and nothing the index names)
    for name in ("rank-00003.safetensors", "rank-00004.done", "rank-00001.wsdelta"):
        shutil.copy(attempt / "rank-00000.safetensors", attempt / name)
    cleaned = subprocess.run([sys.executable, "-m", "weightstore", "clean", str(folder), "--json"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cleaned.returncode == 0, cleaned.stderr
    assert sorted(json.loads(cleaned.stdout)["removed"]) == [
        f"step-000000000001.attempt-1/{name}" for name in ("rank-00001.wsdelta", "rank-00003.safetensors",
                                                           "rank-00004.done")]
    assert sorted(p.name for p in attempt.iterdir()) == named
    assert ws.load(version)["w"].tobytes() == (w + 3).tobytes()


def test_a_rank_file_the_commit_cannot_remove_is_left_with_a_warning_not_a_failed_commit(tmp_path, monkeypatch):
    """The commit sweeps unnamed rank files after LATEST moved: one it may not delete (no delete
    permission, an object lock) is warned of and left; the commit still returns its version
    (raising there told every rank a published step had failed, and its retry was refused)."""
    from weightstore.io.folders import LocalFolder

    folder = tmp_path / "run"
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    for rank, world in ((1, 2), (0, 1)):  # a launch of 2 whose rank 0 never wrote, then one of 1
        ws.publish_shard(folder, {"w": ws.Piece(w[rank * 8 // world:(rank + 1) * 8 // world], (rank * 8 // world, 0),
                                                w.shape)}, step=1, rank=rank, world=world, attempt=0)
    real_remove = LocalFolder.remove

    def locked(self, name):
        if name.startswith("rank-00001"):
            raise PermissionError(1, "Operation not permitted", name)
        return real_remove(self, name)

    monkeypatch.setattr(LocalFolder, "remove", locked)
    with pytest.warns(UserWarning, match="rank-00001.*cannot be removed"):
        version = shards.commit_shards(folder, step=1, world=1, attempt=0, timeout=5)
    assert version.step == 1 == ws.latest(folder).step
    assert ws.load(version)["w"].tobytes() == w.tobytes()
    # a stale attempt's folder the commit of the next attempt may not remove: warned of, committed
    ws.publish_shard(folder, {"w": w + 1}, step=2, rank=0, world=1, attempt=0)
    ws.publish_shard(folder, {"w": w + 2}, step=2, rank=0, world=1, attempt=1)

    def locked_folder(self, name, owned):
        raise ws.StorageError("AccessDenied (an object lock)", path=name)

    monkeypatch.setattr(LocalFolder, "remove_folder", locked_folder)
    with pytest.warns(UserWarning, match="step 2 is published.*AccessDenied"):
        version = shards.commit_shards(folder, step=2, world=1, attempt=1, timeout=5)
    assert version.step == 2 == ws.latest(folder).step and ws.load(version)["w"].tobytes() == (w + 2).tobytes()


def test_a_list_of_numbers_is_an_array_not_a_list_of_pieces(tmp_path):
    folder = tmp_path / "run"
    ws.publish_shard(folder, {"w": [1.0, 2.0, 3.0]}, step=1, rank=0, world=1, attempt=0)
    version = shards.commit_shards(folder, step=1, world=1, attempt=0, timeout=5)
    np.testing.assert_array_equal(ws.load(version)["w"], [1.0, 2.0, 3.0])


@pytest.mark.parametrize("fmt, suffix", [("npz", ".npz"), ("hdf5", ".h5"), ("safetensors", ".safetensors")])
def test_members_in_each_format_read_back_bit_exact(tmp_path, fmt, suffix):
    folder = tmp_path / "run"
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=0, format=fmt)
    version = shards.commit_shards(folder, step=2, world=4, attempt=0, timeout=5)
    expected = model()
    with ws.open(version) as store:
        for key, value in expected.items():
            assert store[key].dtype == value.dtype and store[key].tobytes() == value.tobytes(), key
        for part in range(3):  # a reader by thirds of a version four ranks wrote
            rows = slice(part * 32, (part + 1) * 32)
            assert store.read_region("dense/kernel", (rows, slice(100, 1100))).tobytes() == (
                expected["dense/kernel"][rows, 100:1100].tobytes())
        assert store.read_region("two", (slice(5, 35),)).tobytes() == expected["two"][5:35].tobytes()
    member = folder / "step-000000000002.attempt-0" / f"rank-00001{suffix}"
    with ws.open(member) as alone:  # an ordinary file of its format, under the global keys
        assert sorted(alone) == sorted([*KERNEL_STRIPS, "emb", "two@0,0", "two@20,0"])
        assert alone["two@20,0"].tobytes() == expected["two"][20:30].tobytes()
        assert alone.info("emb").dtype == "bfloat16"
    if fmt == "npz":
        with np.load(member) as plain:
            assert plain["dense/kernel@24,64"].tobytes() == expected["dense/kernel"][24:48, 64:128].tobytes()


def test_a_member_format_that_cannot_be_read_by_ranges_is_refused(tmp_path):
    with pytest.raises(ValueError, match="safetensors, npz or hdf5"):
        ws.publish_shard(tmp_path / "run", {"w": np.zeros(2)}, step=1, rank=0, world=1, attempt=0, format="sharded")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("rank-*"))
    # what a member's byte ranges come from refuses bytes that are not the tensor's as in memory
    for name in ("deflated.npz", "deflated.h5"):
        ws.save(tmp_path / name, {"w": np.arange(50_000, dtype=np.float32)}, compress=True)
        with ws.open(tmp_path / name) as store, pytest.raises(ws.FormatError, match="compressed") as caught:
            store._reader.extent("w")
        assert caught.value.key == "w" and caught.value.path == str(tmp_path / name)


def test_a_member_whose_bytes_are_not_where_its_format_says_is_refused(tmp_path, monkeypatch):
    """The guard against a format that would place a piece's bytes other than as they are in
    memory: an extent off by a few bytes (as a format's bug would give) is refused at write
    time, naming the key, and no done-record is written."""
    from weightstore.formats.npz import NpzReader

    extent = NpzReader.extent
    monkeypatch.setattr(NpzReader, "extent", lambda self, key: (extent(self, key)[0] - 8, extent(self, key)[1]))
    folder = tmp_path / "run"
    with pytest.raises(ws.WeightStoreError, match="not where the format says") as caught:
        ws.publish_shard(folder, {"w": np.arange(20, dtype=np.float32)}, step=1, rank=0, world=1, attempt=0,
                         format="npz")
    assert caught.value.key == "w" and caught.value.path == str(folder / "step-000000000001.attempt-0" / "rank-00000.npz")
    assert not list(folder.rglob("*.done")) and not list(folder.rglob("*.npz"))
    assert not [path for path in folder.rglob("*") if path.is_file()]  # no temporary left either


@pytest.mark.parametrize("shape, itemsize, world, columns", [
    ((768, 4096), 4, 4, 64),        # 256-byte strip rows: 64 float32 columns
    ((768, 4096), 2, 4, 128),       # or 128 bfloat16 ones
    ((100, 128), 4, 1, None),       # under 64 KiB: kept whole
    ((4096, 200), 4, 1, None),      # rows of 800 bytes: fewer than four strips, kept whole
    ((32, 32000), 4, 128, 512),     # 128 ranks: 63 strips each, so the key keeps under 16,384 pieces
    ((32, 32000), 4, 4096, None),   # 4,096 ranks: no room for strips at all
])
def test_strips_are_power_of_two_columns_and_keep_a_key_under_its_piece_limit(shape, itemsize, world, columns):
    from weightstore.core.limits import MAX_PIECES_PER_KEY
    from weightstore.formats._sharded_index import strip_columns

    assert strip_columns(shape, itemsize, world) == columns
    if columns:
        assert world * -(-shape[1] // columns) <= MAX_PIECES_PER_KEY // 2


def test_a_large_member_lets_each_column_strip_go_once_written(tmp_path, monkeypatch):
    """A member past the writer's hold streams from its first strip, however small the strips
    (here 64 KiB, under the size written straight from memory): none is kept back for an exact
    header, so the save holds about a strip and a gathered write at a time, not the hold's
    worth of copies (each a fresh page per 4 KiB)."""
    import tracemalloc

    from weightstore.formats import safetensors as st_format

    monkeypatch.setattr(st_format, "_HOLD_BYTES", 8 << 20)
    pieces = {f"layer_{i}": ws.Piece(np.full((256, 4096), i, np.float32), (256, 0), (1024, 4096)) for i in range(4)}
    ws.publish_shard(tmp_path / "warm", pieces, step=1, rank=1, world=4, attempt=0)  # imports and caches, untraced
    tracemalloc.start()
    try:
        ws.publish_shard(tmp_path / "run", pieces, step=1, rank=1, world=4, attempt=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20, peak  # held, the 16 MB member kept the hold's 8 MB of strips (9 MB at its peak)
    member = tmp_path / "run" / "step-000000000001.attempt-0" / "rank-00001.safetensors"
    with ws.open(member) as store:
        assert len(store) == 256 and all(store[name].shape == (256, 64) for name in store)
        assert (store["layer_3@256,4032"] == 3).all()


def test_a_commit_of_another_world_size_than_its_ranks_fails_at_once(tmp_path):
    """Ranks that wrote a version of 2 and a coordinator told 3 (a relaunch with another size):
    rank 2 never comes, so the commit fails on the lowest rank's record (rank 0's, whatever order
    the file system lists them in), naming it, rather than waiting out its timeout
    (ShardTimeoutError); LATEST stays where it was."""
    folder = tmp_path / "run"
    ws.publish(folder, {"a": np.zeros(1)}, step=1)
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    for rank in range(2):
        ws.publish_shard(folder, {"w": ws.Piece(a[2 * rank : 2 * rank + 2], (2 * rank, 0), a.shape)}, step=2,
                         rank=rank, world=2, attempt=0)
    for world in (3, 1):
        with pytest.raises(ws.PublishError, match=f"done-record is for step 2 attempt 0 rank 0 of 2, not step 2 "
                                                  f"attempt 0 of {world}") as caught:
            shards.commit_shards(folder, step=2, world=world, attempt=0, timeout=60)
        assert caught.value.path == str(folder / "step-000000000002.attempt-0" / "rank-00000.done")
    assert ws.latest(folder).step == 1
    assert shards.commit_shards(folder, step=2, world=2, attempt=0, timeout=60).step == 2


def test_a_key_whose_ranks_together_pass_its_piece_limit_is_not_committed(tmp_path, monkeypatch):
    """Each done-record is under the limit, their sum is not: the coordinator refuses it, as
    every reader would refuse the index, and LATEST stays where it was."""
    from weightstore.formats import _sharded_index as shardindex

    monkeypatch.setattr(shardindex, "MAX_PIECES_PER_KEY", 4)  # the coordinator's check
    monkeypatch.setattr(shards, "MAX_PIECES_PER_KEY", 4)  # the rank's, before it writes
    folder = tmp_path / "run"
    ws.publish(folder, {"a": np.zeros(1)}, step=1)
    a = np.arange(12, dtype=np.float32).reshape(6, 2)
    for rank in range(2):
        rows = range(3 * rank, 3 * rank + 3)
        ws.publish_shard(folder, {"w": [ws.Piece(a[row : row + 1], (row, 0), (6, 2)) for row in rows]},
                         step=2, rank=rank, world=2, attempt=0)
    with pytest.raises(ws.PublishError, match="6 pieces, over 4") as caught:
        shards.commit_shards(folder, step=2, world=2, attempt=0, timeout=5)
    with pytest.raises(ws.SizeLimitError, match="'w': has 5 pieces") as alone:  # one rank: refused before writing
        ws.publish_shard(folder, {"w": [ws.Piece(a[row : row + 1], (row, 0), (6, 2)) for row in range(5)]},
                         step=3, rank=0, world=1, attempt=0)
    assert not (folder / "step-000000000003.attempt-0").exists()
    assert alone.value.key == "w" and alone.value.path.endswith("rank-00000.safetensors")
    assert caught.value.key == "w" and caught.value.path.endswith("step-000000000002.wsindex")
    assert ws.latest(folder).step == 1 and not (folder / "step-000000000002.wsindex").exists()


def hostile_v2(tmp_path, edit=None, table=None):
    """A version 2 index of two ranks (``w``, 6 x 4, by rows) whose index (``edit``) or rank 1's
    block table header (``table``) a hostile writer edited and sealed again, the index giving the
    table's new size and BLAKE3."""
    import blake3

    folder = tmp_path / "run"
    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    for rank in range(2):
        ws.publish_shard(folder, {"w": ws.Piece(a[3 * rank:3 * rank + 3], (3 * rank, 0), (6, 4))},
                         step=1, rank=rank, world=2, attempt=0)
    path = Path(shards.commit_shards(folder, step=1, world=2, attempt=0, timeout=5).path)
    raw = json.loads(path.read_text())
    raw.pop("crc32")
    if table is not None:
        blocks = folder / "step-000000000001.attempt-0" / "rank-00001.blocks"
        data = blocks.read_bytes()
        length = int.from_bytes(data[8:16], "little")
        header = json.loads(data[16:16 + length])
        header.pop("crc32")
        count = raw["members"]["digests"][1] // 32
        crcs, digests = data[16 + length:16 + length + 4 * count], data[16 + length + 4 * count:]
        edited = table(header, crcs)
        if edited is not None:  # the hostile writer hashes its pages of CRC-32s again too
            crcs = edited
            header["pages"] = [blake3.blake3(crcs[at:at + 4 * PAGE_CRCS]).hexdigest()
                               for at in range(0, len(crcs), 4 * PAGE_CRCS)]
        sealed = seal(header)
        head = data[:8] + len(sealed).to_bytes(8, "little") + sealed
        blocks.write_bytes(head + crcs + digests)
        raw["members"]["heads"][1], raw["members"]["blake3"][1] = len(head), blake3.blake3(head).hexdigest()
        if isinstance(header.get("blocks"), int):
            raw["members"]["digests"][1] = 32 * header["blocks"]
    if edit is not None:
        edit(raw)
    path.write_bytes(seal(raw))
    return str(path)


@pytest.mark.parametrize("edit, words", [
    (lambda raw: raw["layouts"][0].__setitem__(1 + 5, 5), "member 5, of 2"),
    (lambda raw: raw["layouts"][0].__setitem__(1 + 5 + 1, 2), "overlap"),
    (lambda raw: raw["tensors"]["w"].__setitem__(1, [7, 4]), "do not cover"),
    (lambda raw: raw["tensors"]["w"].__setitem__(1, [6, 4, 1]), "layout of 2-dimensional pieces"),
    (lambda raw: raw["tensors"]["w"].__setitem__(2, 3), "one of 1 layouts"),
    (lambda raw: raw["tensors"]["w"].__setitem__(0, "object"), "unknown dtype"),
    (lambda raw: raw["layouts"][0].__setitem__(2, 2 ** 63), "below 2\\*\\*62"),
    (lambda raw: raw["layouts"][0].extend(raw["layouts"][0][1:6] * 20000), "pieces, over"),
    (lambda raw: raw["layouts"][0].append(1), "not 2-dimensional boxes"),
    (lambda raw: raw["tensors"].update({f"v{i}": ["float32", [6 + i, 4], 0] for i in range(1, 5)}), "tiles shape"),
])
def test_a_hostile_version_2_index_is_refused_naming_file_and_key(tmp_path, edit, words):
    path = hostile_v2(tmp_path, edit)
    with pytest.raises(ws.FormatError, match=words) as caught:
        ws.open(path)
    assert caught.value.path == path and caught.value.key in ("w", "v1", None)


@pytest.mark.parametrize("edit, words", [
    (lambda raw: raw["members"]["files"].__setitem__(0, "../../etc/passwd"), "member 0 must be"),
    (lambda raw: raw["members"]["blake3"].__setitem__(0, "0" * 63), "block table digest"),
    (lambda raw: raw["members"]["sizes"].pop(), "one per rank"),
    (lambda raw: raw["members"]["digests"].__setitem__(0, 7), "not of a size a table has"),
])
def test_a_hostile_version_2_index_cannot_name_other_files_or_tables(tmp_path, edit, words):
    path = hostile_v2(tmp_path, edit)
    with pytest.raises(ws.FormatError, match=words) as caught:
        ws.open(path)
    assert caught.value.path == path


def _piece_field(at):
    """An edit of rank 1's one piece record, ``[key, dtype, ndim, start.., shape.., columns, rows,
    first, strips, offsets..]``, at field ``at`` from the end of its axes."""
    def edit(value):
        return lambda header, crcs: header["pieces"][0].__setitem__(3 + 2 * 2 + at, value)
    return edit


@pytest.mark.parametrize("table, words", [
    (_piece_field(4)(10 ** 9), "past the end of member"),
    (_piece_field(1)(0), "blocks are not the next"),
    (_piece_field(2)(1), "blocks are not the next"),
    (_piece_field(0)(1), "strip offsets"),
    (lambda header, crcs: header.update(blocks=2), "has pieces of 1 blocks, and 2 CRC-32s"),
    (lambda header, crcs: header.update(pages=[]), "no BLAKE3 of each page"),
    (lambda header, crcs: header.update(size=1), "is not the table of"),
    (lambda header, crcs: (header.update(blocks=2), header["pieces"].append(
        header["pieces"][0][:3] + [0, 0, 3, 4, 0, 1024, 1, 1, header["pieces"][0][-1]]))[0] or crcs * 2,
     "overlap another"),
    (lambda header, crcs: header["pieces"][0].__setitem__(0, "v"), "has no float32 piece at \\[3, 0\\]"),
    (lambda header, crcs: header["pieces"][0].__setitem__(1, "float16"), "has no float32 piece"),
    (lambda header, crcs: header["pieces"][0].__setitem__(2, 40), "too short for its axes"),
    (lambda header, crcs: header.update(digest="xxh3"), "block digests of a kind this weightstore does not know"),
])
def test_a_hostile_block_table_is_refused_naming_it_and_the_key(tmp_path, table, words):
    path = hostile_v2(tmp_path, table=table)
    with ws.open(path) as store:
        assert store.read_region("w", (slice(0, 3),)).tolist() == np.arange(12).reshape(3, 4).tolist()  # rank 0's
        with pytest.raises(ws.FormatError, match=words) as caught:
            store.read_region("w", (slice(3, 6),))
    assert caught.value.key == "w" and caught.value.path.endswith(("rank-00001.blocks", ".wsindex"))


def test_a_block_table_not_the_one_the_index_names_fails_its_checksum(tmp_path):
    path = hostile_v2(tmp_path)
    blocks = Path(path).parent / "step-000000000001.attempt-0" / "rank-00001.blocks"
    data = bytearray(blocks.read_bytes())
    data[20] ^= 1
    blocks.write_bytes(bytes(data))
    with ws.open(path) as store, pytest.raises(ws.ChecksumError, match="not the block table the index names") as caught:
        store["w"]
    assert caught.value.path.endswith("rank-00001.blocks") and caught.value.key == "w"
    data[20] ^= 1
    head = json.loads(Path(path).read_bytes()[:-1].rsplit(b',"crc32"', 1)[0] + b"}")["members"]["heads"][1]
    data[head] ^= 1  # a CRC-32 in its page: the page is refused, naming the table
    blocks.write_bytes(bytes(data))
    with ws.open(path) as store, pytest.raises(ws.ChecksumError, match="page 0 of CRC-32s does not match") as caught:
        store["w"]
    assert caught.value.path.endswith("rank-00001.blocks") and caught.value.key == "w"
    data[head] ^= 1
    data[-1] ^= 1  # a block digest: a reader never fetches them; a follower's region digest is refused
    blocks.write_bytes(bytes(data))
    with ws.open(path) as store:
        assert store["w"].shape == (6, 4)
        with pytest.raises(ws.ChecksumError, match="block digests do not match"):
            store.region_digest("w", (slice(3, 6),))


def test_a_rank_whose_share_would_take_the_index_past_its_bound_is_refused_before_writing(tmp_path, monkeypatch):
    """Each rank checks its share of the index (docs/sharded.md, Bounds) before it writes a
    byte: the index of any version whose ranks all pass stays under MAX_INDEX_BYTES."""
    from weightstore.formats import _sharded_index as shardindex

    folder = tmp_path / "run"
    share = (limits.MAX_INDEX_BYTES - limits.KEY_BYTES - limits.RESERVED_BYTES) // 200_000  # 230 bytes
    pieces = {f"w{i}": ws.Piece(np.zeros((1, 4), np.float32), (i, 0), (200_000, 4)) for i in range(8)}
    with pytest.raises(ws.SizeLimitError, match=f"over the {share} bytes each of 200000 ranks") as caught:
        ws.publish_shard(folder, pieces, step=1, rank=7, world=200_000, attempt=0)
    assert caught.value.path.endswith("rank-00007.safetensors") and not folder.exists()
    ws.publish_shard(folder, dict(list(pieces.items())[:2]), step=1, rank=7, world=200_000, attempt=0)  # within it
    monkeypatch.setattr(shardindex, "KEY_BYTES", 60)  # keys: each rank's own, then the union at the commit
    monkeypatch.setattr(shards, "KEY_BYTES", 60)
    with pytest.raises(ws.SizeLimitError, match=r"keys \(1\) would take 62 bytes of the version's index, over the 60"):
        ws.publish_shard(folder, {"a" * 40: np.zeros(2)}, step=2, rank=0, world=2, attempt=0)
    assert not (folder / "step-000000000002.attempt-0").exists()
    for rank in range(2):
        ws.publish_shard(folder, {f"k{rank}" * 10: np.zeros(2)}, step=2, rank=rank, world=2, attempt=0)
    with pytest.raises(ws.PublishError, match="2 keys would take .* over the 60"):
        shards.commit_shards(folder, step=2, world=2, attempt=0, timeout=5)
    assert not (folder / "step-000000000002.wsindex").exists()


def test_an_index_or_done_record_dense_with_json_containers_is_refused_before_parsing(tmp_path):
    """Empty lists cost Python 56 bytes for 3 bytes of text: 63 MB of them parsed into 2 GB.
    Readers refuse such a file unparsed; a coordinator whose metadata would make its index one
    refuses it before committing, so no reader ever meets an index it cannot open."""
    from weightstore.formats._sharded_index import parse_done

    dense = {"format": "weightstore-shard-done", "version": 1, "pad": [[] for _ in range(20_000)]}
    with pytest.raises(ws.UnsafeFileError, match="JSON objects and arrays"):
        parse_done(seal(dense))
    with pytest.raises(ws.UnsafeFileError, match="JSON objects and arrays"):
        ShardIndex.parse(seal({**dense, "format": "weightstore-sharded"}))
    path = hostile_index(tmp_path, lambda raw: raw["metadata"].update(pad=[[] for _ in range(20_000)]))
    with pytest.raises(ws.UnsafeFileError) as caught:
        ws.open(path)
    assert caught.value.path == path
    folder = tmp_path / "dense"
    ws.publish(folder, {"a": np.zeros(1)}, step=1)
    ws.publish_shard(folder, {"w": np.zeros(3)}, step=2, rank=0, world=1, attempt=0)
    with pytest.raises(ws.PublishError, match="JSON objects and arrays") as refused:
        shards.commit_shards(folder, step=2, world=1, attempt=0, timeout=5, metadata={"pad": [[]] * 20_000})
    assert refused.value.path.endswith("step-000000000002.wsindex")
    assert ws.latest(folder).step == 1 and not (folder / "step-000000000002.wsindex").exists()


@pytest.mark.parametrize("damage", ["newer", "flipped"])
def test_clean_keeps_a_committed_version_whose_index_it_cannot_read(tmp_path, damage):
    """An index a newer weightstore wrote, or with one byte flipped, below LATEST with its
    members intact: nothing proves it dead, so clean reports it and keeps it and its members."""
    folder = tmp_path / "run"
    for step in (2, 3):
        for rank in range(4):
            ws.publish_shard(folder, pieces_of(rank), step=step, rank=rank, world=4, attempt=0)
        shards.commit_shards(folder, step=step, world=4, attempt=0, timeout=5, keep=None)
    index = folder / "step-000000000002.wsindex"
    data = index.read_bytes()
    if damage == "newer":
        data = data.replace(b'"version":3', b'"version":4', 1)
    else:
        data = data[:40] + bytes([data[40] ^ 0x01]) + data[41:]
    index.write_bytes(data)
    with pytest.warns(UserWarning, match=r"step-000000000002.wsindex: kept: it cannot be read"):
        assert shards.clean_folder(folder) == []
    assert index.read_bytes() == data and (folder / "step-000000000002.attempt-0").is_dir()


def test_a_coordinator_that_lost_the_latest_race_removes_its_index_and_its_retry_is_accepted(tmp_path, monkeypatch):
    """Another publisher moves LATEST between this commit's index and its swap of LATEST (here, a
    lower step: LATEST does not name ours and never will)."""
    folder = tmp_path / "run"
    ws.publish(folder, {"w": np.ones(2, np.float32)}, step=1)
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(rank), step=6, rank=rank, world=4, attempt=0)
    real_latest = _publish._write_latest

    def another_publisher_first(target, state, pointer, step):
        monkeypatch.setattr(_publish, "_write_latest", real_latest)
        _publish._write_latest(target, state, pointer.replace(b"step-000000000006.wsindex", b"step-000000000005.npz")
                               .replace(b'"step": 6', b'"step": 5'), 5)
        (folder / "step-000000000005.npz").write_bytes((folder / "step-000000000001.npz").read_bytes())
        raise ws.PublishError("LATEST changed while step 6 was being published", path=str(folder))

    monkeypatch.setattr(_publish, "_write_latest", another_publisher_first)
    with pytest.raises(ws.PublishError, match="LATEST changed"):
        shards.commit_shards(folder, step=6, world=4, attempt=0, timeout=5)
    assert not (folder / "step-000000000006.wsindex").exists() and ws.latest(folder).step == 5
    for rank in range(4):  # the retry the error recommends
        ws.publish_shard(folder, pieces_of(rank), step=7, rank=rank, world=4, attempt=0)
    assert shards.commit_shards(folder, step=7, world=4, attempt=0, timeout=5, keep=2).step == 7
    assert [entry.step for entry in versions.list_versions(folder)] == [5, 7]


@pytest.mark.parametrize("planted", ["LATEST", ".publishing", "step-000000000002.npz",
                                     "step-000000000003.attempt-0/rank-00000.safetensors",
                                     "step-000000000003.attempt-0/rank-00001.done"])
def test_no_publish_writes_through_a_planted_symlink(tmp_path, planted):
    folder, outside = tmp_path / "run", tmp_path / "outside"
    outside.write_bytes(b"not yours")
    ws.publish(folder, {"w": np.ones(2, np.float32)}, step=1)
    (folder / planted).parent.mkdir(exist_ok=True)
    (folder / planted).unlink(missing_ok=True)
    (folder / planted).symlink_to(outside)
    with pytest.raises(ws.WeightStoreError, match="symbolic link"):
        if "attempt" in planted:
            for rank in range(4):
                ws.publish_shard(folder, pieces_of(rank), step=3, rank=rank, world=4, attempt=0)
        else:
            ws.publish(folder, {"w": np.zeros(2, np.float32)}, step=2)
    assert outside.read_bytes() == b"not yours"


def _sealed_text(body: bytes) -> bytes:
    """A document's text sealed as :func:`seal` seals it, for text orjson will not write (nested past 255)."""
    from weightstore.core.manifest import crc32

    body = body[:-1]
    return body + b',"crc32":%d}' % crc32(np.frombuffer(body, np.uint8))


#: (field, depth, version) of each index nesting a field deep
DEEP = [(field, depth, version) for field, depth in [("created", 1020), ("producer", 1020), ("created", 150),
                                                     ("metadata", 1000), ("metadata", 101)] for version in (1, 3)]

#: ``ws ls --json`` of each path in ``sys.argv``, in one process: its exit code and output, as JSON
LS_EACH = textwrap.dedent("""
    import contextlib, io, json, sys
    from weightstore.cli.main import app
    said = []
    for path in sys.argv[1:]:
        out, code = io.StringIO(), 0
        with contextlib.redirect_stdout(out):
            try:
                app(["ls", "--json", path], prog_name="ws")
            except SystemExit as exc:
                code = exc.code
        said.append([code, out.getvalue()])
    print(json.dumps(said))
""")


def _deep_index(folder: Path, field: str, depth: int, version: int) -> str:
    """An index of ``version`` whose ``field`` nests ``depth`` deep, and little else."""
    path = (hostile_index if version == 1 else hostile_v2_index)(folder, lambda raw: raw.update(metadata={}))
    raw = json.loads(Path(path).read_text())
    raw.pop("crc32")
    assert raw["version"] == version
    raw[field] = "HERE" if field != "metadata" else {"note": "HERE"}
    text = json.dumps(raw, separators=(",", ":")).replace('"HERE"', "[" * depth + "1" + "]" * depth)
    Path(path).write_bytes(_sealed_text(text.encode()))
    assert Path(path).stat().st_size < 2 * depth + (2100 if version == 1 else 1000)  # the nesting, and little else
    return path


@pytest.fixture(scope="module")
def deep_indexes(tmp_path_factory):
    """Each of :data:`DEEP`'s indexes, with what ``ws ls --json`` said of it (one process lists them all)."""
    paths = [_deep_index(tmp_path_factory.mktemp("deep"), *case) for case in DEEP]
    result = subprocess.run([sys.executable, "-c", LS_EACH, *paths], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(zip(DEEP, zip(paths, json.loads(result.stdout), strict=True), strict=True))


@pytest.mark.parametrize("field, depth, version", DEEP)
def test_an_index_nesting_a_field_deep_is_refused_naming_the_file(deep_indexes, field, depth, version):
    """A 2 KB index whose ``created`` nests 1,020 deep (orjson parses 1,024) leaked RecursionError
    from ``str()`` at open; metadata as deep leaked one wherever it was shown. Either version."""
    path, (code, listed) = deep_indexes[field, depth, version]
    with pytest.raises(ws.FormatError, match=field) as caught:
        ws.open(path)
    assert caught.value.path == path
    assert code == 1 and '"type": "FormatError"' in listed, listed


#: opens a sharded version under a soft limit of 128 open files and reads it whole and in parts,
#: counting this process's open descriptors as it goes
UNDER_FILE_LIMIT = textwrap.dedent("""
    import os, resource, sys
    import numpy as np
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import weightstore as ws
    from weightstore.formats.sharded import open_files_limit
    path, world = sys.argv[1], int(sys.argv[2])
    expected = np.arange(world * 2 * 3, dtype=np.float32).reshape(world * 2, 3)
    most = 0
    with ws.open(path) as store:
        assert np.array_equal(store["w"], expected)
        most = max(most, len(os.listdir("/proc/self/fd")))
        for rank in (0, world - 1, world // 2, 7, world - 1):
            part = store.read_region("w", (slice(2 * rank, 2 * rank + 2),))
            assert np.array_equal(part, expected[2 * rank:2 * rank + 2]), rank
            most = max(most, len(os.listdir("/proc/self/fd")))
        gone = path.replace(".wsindex", ".attempt-0") + "/rank-00003.safetensors"
        os.unlink(gone)  # long closed to make room: refused naming the member, never read as zeros
        try:
            store.read_region("w", (slice(6, 8),))
        except ws.StoreNotFoundError as exc:
            assert exc.path == path and "rank-00003.safetensors" in str(exc), exc
        else:
            raise AssertionError("a removed member was read")
    print(open_files_limit(), most)
""")


def test_a_version_of_more_members_than_open_files_allow_reads_with_bounded_descriptors(tmp_path):
    """Every member was opened at open: 1,100 ranks failed under the default 1,024 open files
    ("Too many open files"). Here 150 ranks under 128: members open as read, at most a quarter
    of the limit at once."""
    folder, world = tmp_path / "run", 150
    full = np.arange(world * 2 * 3, dtype=np.float32).reshape(world * 2, 3)
    for rank in range(world):
        ws.publish_shard(folder, {"w": ws.Piece(full[2 * rank:2 * rank + 2], (2 * rank, 0), full.shape)},
                         step=1, rank=rank, world=world, attempt=0)
    version = ws.commit_shards(folder, step=1, world=world, attempt=0, timeout=60)
    result = subprocess.run([sys.executable, "-c", UNDER_FILE_LIMIT, version.path, str(world)], capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    limit, most = map(int, result.stdout.split())
    assert limit == 32 and most < 128 - 32, result.stdout  # a quarter of 128; the rest left to the process


def test_a_version_of_few_members_stays_readable_when_pruned_while_open(tmp_path):
    """Members of at most open_files_limit() files: all opened at open, so a member removed under an
    open reader (a pruned version) is still read."""
    folder = tmp_path / "run"
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=0)
    version = shards.commit_shards(folder, step=2, world=4, attempt=0, timeout=5)
    with ws.open(version.path) as store:
        for member in (folder / "step-000000000002.attempt-0").glob("*.safetensors"):
            member.unlink()
        assert store["dense/kernel"].tobytes() == model()["dense/kernel"].tobytes()


def test_the_sweep_finds_exactly_the_overlaps_that_comparing_every_pair_finds():
    """The n log n sweep (``_sweep_overlap``) against its plain twin, every pair compared, over
    random boxes along one and two axes: tilings, near tilings and overlapping sets."""
    from weightstore.formats._sharded_index import _sweep_overlap

    rng = np.random.default_rng(11)
    for trial in range(3000):
        axes, count = int(rng.integers(0, 3)), int(rng.integers(1, 12))
        if trial % 3 == 0 and axes == 2:  # a tiling: cut a grid, maybe shift one box
            rows, cols = np.sort(rng.choice(np.arange(1, 10), 2, replace=False)), np.sort(rng.choice(np.arange(1, 10), 2, replace=False))
            r, c = [0, *rows.tolist(), 10], [0, *cols.tolist(), 10]
            boxes = [((r[i], c[j]), (r[i + 1], c[j + 1])) for i in range(3) for j in range(3)]
            if rng.random() < 0.5:
                (a, b), (e, f) = boxes[0]
                boxes[0] = ((a, b), (e + 1, f))
            starts = np.array([s for s, _ in boxes], np.int64)
            ends = np.array([e for _, e in boxes], np.int64)
        else:
            starts = rng.integers(0, 8, (count, axes))
            ends = starts + rng.integers(1, 4, (count, axes))
        plain = any(np.all((starts[i] < ends[j]) & (starts[j] < ends[i]))
                    for i in range(len(starts)) for j in range(i + 1, len(starts)))
        found = _sweep_overlap(starts, ends)
        assert (found is not None) == plain, (starts.tolist(), ends.tolist())
        if found is not None:
            i, j = found
            assert i != j and np.all((starts[i] < ends[j]) & (starts[j] < ends[i]))


@pytest.mark.parametrize("planted", ["step-000000000003.attempt-0", ".publish.lock"])
def test_no_publish_writes_through_a_planted_folder_or_lock_link(tmp_path, planted):
    folder, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    ws.publish(folder, {"w": np.ones(2, np.float32)}, step=1)
    (folder / planted).unlink(missing_ok=True)
    (folder / planted).symlink_to(outside / "target" if planted.endswith("lock") else outside)
    with pytest.raises(ws.TargetError, match="symbolic link"):
        if "attempt" in planted:
            ws.publish_shard(folder, pieces_of(0), step=3, rank=0, world=4, attempt=0)
        else:
            ws.publish(folder, {"w": np.zeros(2, np.float32)}, step=2)
    assert list(outside.iterdir()) == []


def test_clean_reports_what_it_keeps_in_text_and_json(tmp_path):
    folder = tmp_path / "run"
    for step in (2, 3):
        for rank in range(4):
            ws.publish_shard(folder, pieces_of(rank), step=step, rank=rank, world=4, attempt=0)
        shards.commit_shards(folder, step=step, world=4, attempt=0, timeout=5, keep=None)
    (folder / "step-000000000002.wsindex").write_bytes(b"{not an index")
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    def run(*args):
        return CliRunner().invoke(app, [str(arg) for arg in args])

    text = run("clean", folder)
    assert text.exit_code == 0 and "kept " in text.output and "step-000000000002.wsindex" in text.output
    report = json.loads(run("clean", folder, "--json").output)
    assert report["removed"] == [] and len(report["kept"]) == 1 and "cannot be read" in report["kept"][0]


def test_a_done_record_carries_its_job_incarnation_and_older_records_read_without_one():
    from weightstore.formats._sharded_index import DoneRecord, Member, TableRef, parse_done

    member = Member("rank-00000.safetensors", 10, 0, TableRef(64, 0, "0" * 64))  # a version 2 record names its table
    record = DoneRecord(3, 1, 0, 2, member, {}, "job-7f3a")
    parsed = parse_done(record.to_json())
    assert parsed.incarnation == "job-7f3a" and parsed.member.table == member.table
    older = DoneRecord(3, 1, 0, 2, member, {})
    assert b"incarnation" not in older.to_json() and parse_done(older.to_json()).incarnation == ""
    for bad in ("a b", "x" * 65, 7):
        raw = json.loads(record.to_json()[: record.to_json().rindex(b',"crc32"')] + b"}")
        with pytest.raises(ws.FormatError, match="incarnation is not a job incarnation"):
            parse_done(seal({**raw, "incarnation": bad}))


def test_a_first_commit_whose_latest_swap_failed_is_completed_by_its_retry(tmp_path, monkeypatch):
    """As a plain first publish's: the index landed, ``LATEST``'s write failed; the coordinator's
    retry of the same step commits it rather than refusing it as "not after step 2"."""
    from weightstore.sync import _stages as stages

    failed = threading.Event()

    def latest_fails_once(name):
        if name == "latest-temporary" and not failed.is_set():
            failed.set()
            raise OSError(5, "EIO writing LATEST")

    folder = tmp_path / "run"
    for rank in range(4):
        ws.publish_shard(folder, pieces_of(rank), step=2, rank=rank, world=4, attempt=0)
    monkeypatch.setattr(stages, "hook", latest_fails_once)
    with pytest.raises(ws.WriteError, match="EIO writing LATEST"):
        shards.commit_shards(folder, step=2, world=4, attempt=0, timeout=5)
    assert ws.latest(folder) is None
    version = shards.commit_shards(folder, step=2, world=4, attempt=0, timeout=5)
    assert ws.latest(folder).step == 2 == version.step
    assert ws.load(version)["two"].tobytes() == model()["two"].tobytes()
