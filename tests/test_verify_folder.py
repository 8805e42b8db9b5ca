"""``ws verify FOLDER``: every version of a folder ``ws.publish`` writes, checked as a reader reads it.

After an outage or a disk scare, the question is whether the folder is sound: each full version's
checksums, each delta rebuilt from its chain (a damaged anchor is every delta's fault), each
sharded version's blocks. Exit 0 intact, 1 corrupt naming each, 2 when it cannot tell.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
from typer.testing import CliRunner

import weightstore as ws
from weightstore.cli.main import app

BUCKET = "weightstore-verify"
ANCHOR, SECOND, THIRD = "step-000000000001.npz", "step-000000000002.wsdelta", "step-000000000003.wsdelta"
#: the tensor a test damages, and its bytes, found in the anchor's file by them
STILL = np.linspace(-1.0, 1.0, 2500, dtype=np.float32).reshape(50, 50)


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def lines(result) -> list[str]:
    return result.stdout.strip().splitlines()


def publish_deltas(folder):
    """A full version, then two deltas of it: ``moving`` changes each step, ``still`` never."""
    moving = np.arange(1000, dtype=np.float32)
    for step in (1, 2, 3):
        moving = moving.copy()
        moving[step] += 1
        ws.publish(folder, {"moving": moving, "still": STILL}, step=step, delta=True)


def flip_a_byte_of(path, tensor: np.ndarray) -> None:
    data = bytearray(path.read_bytes())
    data[data.index(tensor.tobytes()) + 100] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_sound_folder_of_full_and_delta_versions_is_intact(tmp_path):
    folder = tmp_path / "run"
    publish_deltas(folder)
    result = run("verify", folder)
    assert result.exit_code == 0, result.output
    assert lines(result) == [f"{folder}/{ANCHOR}: ok (full): 2 tensors", f"{folder}/{SECOND}: ok (delta): 2 tensors",
                             f"{folder}/{THIRD}: ok (delta): 2 tensors"]
    document = json.loads(run("verify", folder, "--json").stdout)
    assert (document["ok"], document["folder"], document["latest_error"]) == (True, str(folder), None)
    assert [(v["step"], v["kind"], v["state"], v["count"]) for v in document["versions"]] == [
        (1, "full", "ok", 2), (2, "delta", "ok", 2), (3, "delta", "ok", 2)]


def test_a_damaged_anchor_makes_every_delta_on_it_corrupt_naming_the_anchor(tmp_path):
    """``ws versions`` lists such a folder as fine; each delta's rebuilt tensor fails the digest
    its publisher recorded, and the line says which file of the chain is at fault."""
    folder = tmp_path / "run"
    publish_deltas(folder)
    flip_a_byte_of(folder / ANCHOR, STILL)
    assert run("versions", folder).exit_code == 0
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    found = lines(result)
    assert found[0].startswith(f"{folder}/{ANCHOR}: corrupt (full): tensor 'still': is corrupt (checksum")
    for line, name in zip(found[1:], (SECOND, THIRD), strict=True):
        # what is wrong, said once: the anchor and its checksums, not inside a second message about the digest
        assert line.startswith(f"{folder}/{name}: corrupt (delta): tensor 'still': in its chain, {ANCHOR}: is corrupt "
                               "(checksum crc32:"), line
        assert line.count(ANCHOR) == 1 and "rebuilding" not in line, line
    assert result.stderr.strip() == (f"error: {folder}: 3 of 3 versions corrupt: '{ANCHOR}', '{SECOND}', "
                                     f"'{THIRD}'")
    document = json.loads(run("verify", folder, "--json").stdout)
    assert document["ok"] is False and document["error"]["type"] == "FormatError"
    assert [v["state"] for v in document["versions"]] == ["corrupt"] * 3
    assert [p["key"] for v in document["versions"] for p in v["problems"]] == ["still"] * 3


def test_a_delta_whose_base_is_gone_is_corrupt_and_one_being_written_is_skipped(tmp_path):
    folder = tmp_path / "run"
    publish_deltas(folder)
    (folder / ANCHOR).unlink()  # removed by hand: the deltas cannot be read
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    assert all(line.startswith(f"{folder}/step-") and ": corrupt (delta): " in line for line in lines(result))
    assert ANCHOR in lines(result)[0]
    other = tmp_path / "other"
    publish_deltas(other)
    killed = subprocess.run([sys.executable, "-c", KILLED_PUBLISHER, str(other)], capture_output=True, text=True,
                            timeout=60)  # its step 4 written, LATEST not yet: as a publish under way looks
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    result = run("verify", other)
    assert result.exit_code == 0, result.output
    assert lines(result)[-1] == f"{other}/step-000000000004.wsdelta: skipped (delta): above LATEST's step 3: being written"


def reader_fault(path) -> str:
    """What a reader says of the version at ``path``, without the path (as a ``ws verify`` line says it)."""
    with pytest.raises(ws.FormatError) as refused:
        ws.load(path)
    assert str(refused.value).startswith(f"{path}: ")
    return str(refused.value)[len(f"{path}: "):]


@pytest.mark.parametrize("damage", ["its-own-file-truncated", "the-head-of-its-base-damaged"])
def test_a_delta_verified_onto_the_version_before_is_corrupt_as_a_reader_says(tmp_path, damage):
    """A delta of a version that was just verified is opened onto it, not with its chain: what is
    wrong with it is said once, as a reader says it, not told to be renamed (its own fault), nor
    repeated for each tensor (its chain's: a chain 30 deep of 200 tensors printed 1 MB)."""
    folder = tmp_path / "run"
    publish_deltas(folder)
    if damage == "its-own-file-truncated":
        with open(folder / THIRD, "r+b") as handle:
            handle.truncate((folder / THIRD).stat().st_size - 10)  # its last payload
    else:
        data = bytearray((folder / SECOND).read_bytes())
        data[12] ^= 0xFF  # its header's sizes
        (folder / SECOND).write_bytes(bytes(data))
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    assert lines(result)[2] == f"{folder}/{THIRD}: corrupt (delta): {reader_fault(folder / THIRD)}"


def test_a_delta_on_a_base_holding_its_tensor_as_another_dtype_is_corrupt_as_a_reader_says(tmp_path):
    """The versions below a delta restored from another run's copy, which held the same bytes as
    float32, not int32: a reader refuses the delta (a change of another dtype's tensor), and
    so does ``ws verify``, which rebuilt it onto the bytes verified there and called it ok."""
    folder, other = tmp_path / "run", tmp_path / "other"
    for where, dtype in ((folder, np.int32), (other, np.float32)):
        weights = np.arange(4096, dtype=np.int32)
        for step in (1, 2, 3):
            weights = weights.copy()
            weights[step * 7] += 1
            ws.publish(where, {"w": weights.view(dtype)}, step=step, delta=True)
    for name in (ANCHOR, SECOND):
        (folder / name).write_bytes((other / name).read_bytes())
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    assert lines(result)[1:] == [f"{folder}/{SECOND}: ok (delta): 1 tensor",
                                 f"{folder}/{THIRD}: corrupt (delta): {reader_fault(folder / THIRD)}"]
    assert "not int32" in lines(result)[2]


KILLED_PUBLISHER = """
import os, signal, sys
import numpy as np
import weightstore as ws
from weightstore.sync import _stages as stages

def kill(name):
    if name == "version-written":
        os.kill(os.getpid(), signal.SIGKILL)

stages.hook = kill
moving = np.arange(1000, dtype=np.float32)
moving[1:4] += 1
ws.publish(sys.argv[1], {"moving": moving, "still": np.linspace(-1.0, 1.0, 2500, dtype=np.float32).reshape(50, 50)},
           step=4, delta=True)
"""


def test_a_latest_restored_from_an_older_copy_is_corrupt_and_the_versions_above_it_are_checked(tmp_path):
    """No publish is under way, so a version above LATEST's step is one followers miss and the next
    publish refuses to go past: not "being written", and still read whole."""
    folder = tmp_path / "run"
    publish_deltas(folder)
    (folder / "LATEST").write_bytes((folder / "LATEST").read_bytes().replace(b'"step": 3', b'"step": 2')
                                    .replace(THIRD.encode(), SECOND.encode()))
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    assert lines(result)[-2:] == [
        f"{folder}/{THIRD}: ok (delta): 2 tensors",
        f"{folder}: corrupt: LATEST names step 2, but step 3 above it was published before (was LATEST restored "
        "from an older copy?): followers miss it, and a publish refuses steps up to it; publish a later step, or "
        "move those files away"]


def test_a_latest_naming_a_lost_version_is_corrupt(tmp_path):
    folder = tmp_path / "run"
    ws.publish(folder, {"w": np.zeros(3, np.float32)}, step=1)
    ws.publish(folder, {"w": np.ones(3, np.float32)}, step=2)
    (folder / "step-000000000002.npz").unlink()
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    assert lines(result) == [f"{folder}/step-000000000001.npz: ok (full): 1 tensor",
                             f"{folder}: corrupt: LATEST names step-000000000002.npz, which the folder does not "
                             "hold: followers cannot read it; publish again to repair it"]


def test_a_sharded_version_is_read_block_by_block(tmp_path):
    folder = tmp_path / "run"
    weights = np.arange(600_000, dtype=np.float32).reshape(1000, 600)
    ws.publish(folder, {"w": weights[:10]}, step=1)
    ws.publish_shard(folder, {"w": weights}, step=2, rank=0, world=1, attempt=0)
    ws.commit_shards(folder, step=2, world=1, attempt=0, timeout=5)
    index = f"{folder}/step-000000000002.wsindex"
    result = run("verify", folder)
    assert result.exit_code == 0, result.output
    assert lines(result)[1] == f"{index}: ok (sharded): 1 tensor"
    member = folder / "step-000000000002.attempt-0" / "rank-00000.safetensors"
    data = bytearray(member.read_bytes())
    data[-10] ^= 0xFF  # the last block of w
    member.write_bytes(bytes(data))
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    assert lines(result)[0].endswith(": ok (full): 1 tensor")
    assert lines(result)[1].startswith(f"{index}: corrupt (sharded): tensor 'w': ")


def test_an_empty_or_missing_folder_cannot_be_told_sound(tmp_path):
    """Nothing to check is not "intact": exit 2, as for a missing file, from the installed command."""
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "absent"):
        done = subprocess.run([sys.executable, "-m", "weightstore", "verify", str(folder)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and not done.stdout, done
        assert done.stderr.startswith(f"error: {folder}: ") and "Traceback" not in done.stderr


def test_a_folder_on_s3_and_an_outage_there(s3):
    """The same lines for an S3 folder; an outage mid-way cannot tell: exit 2, not "corrupt"."""
    import s3fs

    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}/run"
    publish_deltas(folder)
    result = run("verify", folder)
    assert result.exit_code == 0, result.output
    assert lines(result) == [f"{folder}/{ANCHOR}: ok (full): 2 tensors", f"{folder}/{SECOND}: ok (delta): 2 tensors",
                             f"{folder}/{THIRD}: ok (delta): 2 tensors"]
    storage = s3fs.S3FileSystem()
    data = bytearray(storage.cat_file(f"{folder}/{ANCHOR}"[len("s3://"):]))
    data[data.index(STILL.tobytes()) + 100] ^= 0xFF
    storage.pipe_file(f"{folder}/{ANCHOR}"[len("s3://"):], bytes(data))
    result = run("verify", folder)
    assert result.exit_code == 1 and f"in its chain, {ANCHOR}: is corrupt" in lines(result)[2], result.output
    down = (503, b"<Error><Code>SlowDown</Code><Message>down</Message></Error>")
    s3.intercept = lambda environ: down if environ["PATH_INFO"].endswith(SECOND) else None
    result = run("verify", folder)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {folder}/{SECOND}: ") and "storage failed" in result.stderr, result.stderr
    # each line is printed as its version is checked: the anchor's before the outage, none after it
    assert [line.split(": ")[:2] for line in lines(result)] == [[f"{folder}/{ANCHOR}", "corrupt (full)"]]


def test_a_version_pruned_while_verifying_is_skipped(s3):
    """A publish with ``keep`` removes the oldest version as the verifier reaches it: not corrupt."""
    import s3fs

    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}/run"
    for step in (1, 2):
        ws.publish(folder, {"w": np.full(3, step, np.float32)}, step=step)
    oldest = f"{folder}/step-000000000001.npz"[len("s3://"):]
    storage = s3fs.S3FileSystem(skip_instance_cache=True)

    def prune_first(environ):
        if environ["REQUEST_METHOD"] in ("GET", "HEAD") and environ["PATH_INFO"].endswith(oldest.rsplit("/")[-1]):
            s3.intercept = None
            storage.rm_file(oldest)
        return None

    s3.intercept = prune_first
    result = run("verify", folder)
    assert result.exit_code == 0, result.output
    assert lines(result) == [f"s3://{oldest}: skipped (full): removed while verifying (pruned)",
                             f"{folder}/step-000000000002.npz: ok (full): 1 tensor"]


def test_a_folder_whose_latest_is_lost_is_corrupt(tmp_path):
    """Followers see no version without LATEST (a killed first publish's own version aside)."""
    folder = tmp_path / "run"
    publish_deltas(folder)
    (folder / "LATEST").unlink()
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    assert lines(result)[-1] == (f"{folder}: corrupt: holds versions up to step 3 but no LATEST: followers see none; "
                                 "publish again to repair it")
    first = tmp_path / "first"
    killed = subprocess.run([sys.executable, "-c", KILLED_PUBLISHER, str(first)], capture_output=True, text=True,
                            timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    result = run("verify", first)
    assert result.exit_code == 0, result.output
    assert lines(result) == [f"{first}/step-000000000004.npz: ok (full): 2 tensors"]


def test_a_version_name_held_by_a_link_a_folder_or_a_fifo_is_listed_corrupt_and_never_opened(tmp_path):
    """What sits at a version's name but is no file is listed by ``ws versions`` ("not a file")
    and corrupt to ``ws verify`` (the real ``ws``: a FIFO opened for reading would hang it), and
    readers refuse it: a link to another folder's weights is never followed."""
    folder, outside = tmp_path / "run", tmp_path / "outside"
    for step in (1, 2, 3, 4):
        ws.publish(folder, {"w": np.full(3, step, np.float32)}, step=step, keep=None)
    outside.mkdir()
    ws.save(outside / "secret.npz", {"w": np.zeros(3, np.float32)})
    for name in ("step-000000000002.npz", "step-000000000003.npz", "step-000000000004.npz"):
        (folder / name).unlink()
    (folder / "step-000000000002.npz").symlink_to(outside / "secret.npz")
    (folder / "step-000000000003.npz").mkdir()
    os.mkfifo(folder / "step-000000000004.npz")  # LATEST names it
    ws_command = [sys.executable, "-m", "weightstore"]
    listed = subprocess.run([*ws_command, "versions", "--json", str(folder)], capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert [(v["step"], v["kind"], v["not_file"], v["latest"]) for v in json.loads(listed.stdout)["versions"]] == [
        (1, "full", None, False), (2, "not a file", f"a symbolic link (to {outside / 'secret.npz'})", False),
        (3, "not a file", "a folder", False), (4, "not a file", "a FIFO", True)]
    result = subprocess.run([*ws_command, "verify", str(folder)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        f"{folder}/step-000000000001.npz: ok (full): 1 tensor",
        f"{folder}/step-000000000002.npz: corrupt (not a file): is a symbolic link (to {outside / 'secret.npz'}), "
        "not a file: no reader opens it",
        f"{folder}/step-000000000003.npz: corrupt (not a file): is a folder, not a file: no reader opens it",
        f"{folder}/step-000000000004.npz: corrupt (not a file): is a FIFO, not a file: no reader opens it",
        f"{folder}: corrupt: LATEST names step-000000000004.npz, which is no file: followers cannot read it; "
        "publish again to repair it"]
    assert result.stderr.startswith(f"error: {folder}: 3 of 4 versions corrupt: ")
    (folder / "LATEST").write_text((folder / "LATEST").read_text().replace("step-000000000004", "step-000000000002")
                                   .replace('"step": 4', '"step": 2'))
    with pytest.raises(ws.FormatError, match="is a symbolic link .*, not a file: .*; to read it, put the file itself "
                                             "in the link's place$"):
        ws.load(ws.latest(folder))
    assert next(ws.follow(folder, timeout=0), None) is None  # passed over, never the other folder's weights


def test_an_empty_folder_has_nothing_to_verify(tmp_path):
    """Before a run's first publish: said so (exit 2, cannot tell), not "no TF checkpoint"."""
    (tmp_path / "run").mkdir()
    result = run("verify", tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: {tmp_path / 'run'}: is an empty folder: no weight file, and no "
                                     "ws.publish versions to verify")


@pytest.mark.slow  # a ws verify process on S3
def test_each_line_is_printed_as_its_version_is_checked(s3):
    """A long folder shows its progress: the real ``ws``, its output a pipe, prints the first
    version's line before the second's file is read (which the storage holds back until the
    test has read that line: a line printed only at the end would keep it waiting)."""
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}/run"
    publish_deltas(folder)
    gate, held_back, anchor_read = threading.Event(), [], threading.Event()

    def hold_second(environ):  # once the anchor is being verified (the listing reads only the deltas' heads)
        if environ["PATH_INFO"].endswith(ANCHOR):
            anchor_read.set()
        elif environ["PATH_INFO"].endswith(SECOND) and anchor_read.is_set() and not gate.is_set():
            held_back.append(gate.wait(30))  # False: the first line was not out while the second waited
        return None

    s3.intercept = hold_second
    with subprocess.Popen([sys.executable, "-m", "weightstore", "verify", folder], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as verifying:
        first = verifying.stdout.readline()
        gate.set()
        rest, errors = verifying.communicate(timeout=120)
    assert verifying.returncode == 0, errors
    assert first == f"{folder}/{ANCHOR}: ok (full): 2 tensors\n"
    assert all(held_back), "the first line came only once the second version was read"
    assert rest.splitlines() == [f"{folder}/{SECOND}: ok (delta): 2 tensors", f"{folder}/{THIRD}: ok (delta): 2 tensors"]


def test_a_chain_is_verified_applying_each_delta_once_not_rebuilding_each_from_its_anchor(s3):
    """Every version's recorded digests are checked, yet the anchor is fetched once for the whole
    chain (each delta rebuilt onto the version before, as verified): rebuilding every delta from
    the anchor fetched it once a version, k² work for a chain of k."""
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}/run"
    big = np.random.default_rng(0).standard_normal(250_000).astype(np.float32)  # 1 MB that never changes
    moving = np.arange(1000, dtype=np.float32)
    delta = ws.Delta(anchor_every=10)
    for step in range(1, 9):
        moving = moving.copy()
        moving[step] += 1
        ws.publish(folder, {"moving": moving, "big": big}, step=step, delta=delta, keep=None)
    s3.reset()
    result = run("verify", folder)
    assert result.exit_code == 0, result.output
    assert [line.split(": ")[1] for line in lines(result)] == ["ok (full)"] + ["ok (delta)"] * 7
    assert s3.bytes_sent() < 2 * big.nbytes, s3.bytes_sent()


def test_a_deep_chain_is_verified_opening_each_file_of_it_a_bounded_number_of_times(tmp_path, monkeypatch):
    """Each delta is opened without the chain below it, onto the version before as verified, and
    each head's chain is checked once, against the head below it: opened whole, every version
    opened each file below it and checked each name its head lists, so ``ws verify`` of a chain
    1,000 deep took minutes (k² for a chain of k). A chain of 60 is read each file at most twice
    (its head listed, then its tensors), and its version names matched a few times a version: k²
    would open its lowest file 60 times and match 1,800 names (the bounds are counts: a deeper
    chain only took longer to publish)."""
    from weightstore.formats import delta as delta_format
    from weightstore.io import files

    folder, deltas = tmp_path / "run", 60
    delta = ws.Delta(anchor_every=deltas + 1)
    weights = {"w": np.zeros(4096, np.float32)}
    for step in range(1, deltas + 2):
        weights["w"][step] += 1
        ws.publish(folder, weights, step=step, delta=delta, keep=None)
    opened: collections.Counter[str] = collections.Counter()
    matched = [0]
    open_fd, step_of = files._open_regular_fd, delta_format._step_of

    def counted_open(path):
        opened[os.path.basename(path)] += 1
        return open_fd(path)

    def counted_step_of(*args, **kwargs):
        matched[0] += 1
        return step_of(*args, **kwargs)

    monkeypatch.setattr(files, "_open_regular_fd", counted_open)
    monkeypatch.setattr(delta_format, "_step_of", counted_step_of)
    result = run("verify", folder)
    assert result.exit_code == 0, result.output
    assert [line.split(": ")[1:] for line in lines(result)] == [["ok (full)", "1 tensor"]] + [
        ["ok (delta)", "1 tensor"]] * deltas
    versions = [name for name in opened if name.startswith("step-")]
    assert len(versions) == deltas + 1 and max(opened[name] for name in versions) <= 2, opened.most_common(3)
    assert matched[0] <= 5 * (deltas + 1), matched[0]


def test_a_sharded_band_digest_that_lies_about_its_bytes_is_corrupt(tmp_path, monkeypatch):
    """A follower's skip-unchanged trusts each band's recorded digest without reading the band:
    one that is not its bytes' (a writer's fault) would keep a changed band unread, serving the
    old weights. Every block reads whole, so only ``ws verify`` making the digests again from
    the bytes sees it, naming the member, the piece and the band: of a piece stored whole
    (``tall``) and of one stored as column strips (``w``), whose bands span every strip."""
    from weightstore.sharded import _shards

    folder = tmp_path / "run"
    weights = {"w": np.arange(600_000, dtype=np.float32).reshape(1000, 600),
               "tall": np.arange(300_000, dtype=np.float32).reshape(100_000, 3), "b": np.ones(7, np.float32)}
    made = _shards.crc_band_digests

    def lying(crc64s, strip_crcs):  # the second band's digest is not of its bytes
        return [digest if band != 1 else bytes(32) for band, digest in enumerate(made(crc64s, strip_crcs))]

    for step in (1, 2):
        if step == 2:
            monkeypatch.setattr(_shards, "crc_band_digests", lying)
        ws.publish_shard(folder, weights, step=step, rank=0, world=1, attempt=0)
        ws.commit_shards(folder, step=step, world=1, attempt=0, timeout=5)
    monkeypatch.undo()
    index = f"{folder}/step-000000000002.wsindex"
    assert all(ws.load(index)[key].tobytes() == value.tobytes() for key, value in weights.items())  # CRC-32s hold
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    assert lines(result)[0] == f"{folder}/step-000000000001.wsindex: ok (sharded): 3 tensors"
    document = json.loads(run("verify", folder, "--json").stdout)
    said = "the block digest of band 1 (rows {} on) of its piece at [0, 0] in member " \
           "step-000000000002.attempt-0/rank-00000.safetensors is not its bytes': a follower would take that band " \
           "for unchanged when it changed"
    found = [(p["key"], p["message"]) for p in document["versions"][1]["problems"]]
    assert [key for key, _ in found] == ["w", "tall"]
    for _, message in found:
        assert message == said.format(message.split("(rows ")[1].split(" ")[0]), message
    result = run("verify", index)
    assert result.exit_code == 1 and "the block digest of band 1" in result.stderr, result.output


def test_a_chain_damaged_low_down_names_that_file_above_it_opening_each_file_a_bounded_number_of_times(
        tmp_path, monkeypatch):
    """A delta damaged in the middle of a deep chain is every version's above it fault: each is
    reported as built on it, naming that file, without its tensor rebuilt from the anchor again
    (a chain of 300 damaged at 150 took 26 s, each version above reading the 150 below it)."""
    from weightstore.io import files

    folder, deltas, damaged = tmp_path / "run", 60, 30
    delta = ws.Delta(anchor_every=deltas + 1)
    weights = {"w": np.zeros(4096, np.float32), "still": STILL}
    for step in range(1, deltas + 2):
        weights["w"][step] += 1
        ws.publish(folder, weights, step=step, delta=delta, keep=None)
    name = f"step-{damaged:012d}.wsdelta"
    data = bytearray((folder / name).read_bytes())
    data[-5] ^= 0xFF  # inside the last payload: that delta's change of "w"
    (folder / name).write_bytes(bytes(data))
    opened: collections.Counter[str] = collections.Counter()
    open_fd = files._open_regular_fd

    def counted_open(path):
        opened[os.path.basename(path)] += 1
        return open_fd(path)

    monkeypatch.setattr(files, "_open_regular_fd", counted_open)
    result = run("verify", folder)
    assert result.exit_code == 1, result.output
    versions = [file for file in opened if file.startswith("step-")]
    assert len(versions) == deltas + 1 and max(opened[file] for file in versions) <= 3, opened.most_common(3)
    found = lines(result)
    assert all(": ok (" in line for line in found[:damaged - 1]), found[:damaged - 1]
    assert f"{folder}/{name}: corrupt (delta): tensor 'w'" in found[damaged - 1]
    for line in found[damaged:]:
        assert f": corrupt (delta): tensor 'w': in its chain, {name}: " in line, line
        assert line.count(name) == 1, line
    document = json.loads(run("verify", folder, "--json").stdout)
    assert [v["state"] for v in document["versions"]] == ["ok"] * (damaged - 1) + ["corrupt"] * (deltas + 2 - damaged)
    assert {p["key"] for v in document["versions"] for p in v["problems"]} == {"w"}
