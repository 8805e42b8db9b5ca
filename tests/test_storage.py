"""What a write may replace, and what a versioned folder never loses.

Special files are never replaced, symlinks are written through, permissions survive a re-save,
and a folder whose LATEST went back, or is not a file at all, loses no version and hangs no one.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import weightstore as ws
from weightstore import sync as versions

WEIGHTS = {"dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4)}


def weights_at(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((4,), step, np.float32)}


def names(folder) -> list[str]:
    return sorted(os.listdir(folder))


# -- targets a save must not replace ------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_save_refuses_a_fifo_and_leaves_it(tmp_path, suffix):
    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    with pytest.raises(ws.TargetError, match=r"pipe.*is a FIFO; weightstore only replaces regular files") as caught:
        ws.save(fifo, WEIGHTS)
    assert caught.value.path == str(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert names(tmp_path) == [fifo.name]  # no temporary was written first


def test_save_refuses_a_device(tmp_path):
    with pytest.raises(ws.TargetError, match="is a character device"):
        ws.save("/dev/null", WEIGHTS, format="npz")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_save_onto_a_folder_is_refused_before_writing(tmp_path):
    folder = tmp_path / "model.npz"
    folder.mkdir()
    with pytest.raises(ws.TargetError, match="is a folder"):
        ws.save(folder, WEIGHTS)
    assert names(tmp_path) == ["model.npz"] and os.listdir(folder) == []


def test_save_through_a_symlink_replaces_the_file_it_names_and_keeps_the_link(tmp_path):
    real = tmp_path / "runs" / "42" / "model.npz"
    real.parent.mkdir(parents=True)
    ws.save(real, {"w": np.zeros(2, np.float32)})
    link = tmp_path / "model.npz"
    link.symlink_to(real)
    ws.save(link, WEIGHTS)
    assert link.is_symlink() and os.readlink(link) == str(real)
    np.testing.assert_array_equal(ws.load(real)["dense/kernel"], WEIGHTS["dense/kernel"])
    assert names(real.parent) == ["model.npz"]  # the temporary went beside the real file, and is gone


def test_resave_keeps_the_files_permissions(tmp_path):
    path = tmp_path / "secret.npz"
    ws.save(path, WEIGHTS)
    os.chmod(path, 0o600)
    ws.save(path, {"w": np.ones(3)})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("name", ["model.safetensors.bak", "model.xyz", "model"])
def test_unknown_output_suffix_is_refused_before_writing(tmp_path, name):
    with pytest.raises(ws.TargetError, match=r"cannot tell which format to write from the file name; name it with one of \.npz"):
        ws.save(tmp_path / name, WEIGHTS)
    assert names(tmp_path) == []
    ws.save(tmp_path / name, WEIGHTS, format="npz")  # an explicit format is always honoured
    np.testing.assert_array_equal(ws.load(tmp_path / name)["dense/kernel"], WEIGHTS["dense/kernel"])


def test_an_unknown_format_word_is_a_weightstore_error_naming_the_file_and_the_word_meant(tmp_path):
    """``format="h5"`` is what a user of ``.h5`` files types: refused as one of ours, naming "hdf5"."""
    ws.save(tmp_path / "m.npz", WEIGHTS)
    for call in (lambda: ws.save(tmp_path / "m.weights", WEIGHTS, format="h5"),
                 lambda: ws.open(tmp_path / "m.npz", format="h5"),
                 lambda: ws.publish_shard(tmp_path / "run", WEIGHTS, step=1, rank=0, world=1, attempt=0, format="h5")):
        with pytest.raises(ws.FormatError, match="unknown format 'h5'; known: npz, .*hdf5.*; did you mean 'hdf5'"):
            call()
    assert names(tmp_path) == ["m.npz"]
    with pytest.raises(ws.FormatError) as caught:
        ws.save(tmp_path / "m.weights", WEIGHTS, format="pickle")
    assert caught.value.path == str(tmp_path / "m.weights") and "did you mean" not in str(caught.value)


def test_a_url_of_unknown_storage_is_a_weightstore_error_from_python_and_the_command(tmp_path):
    """fsspec's own ``ValueError("Protocol not known")`` was what a typo in a URL gave."""
    for call in (lambda: ws.load("foo://bucket/m.npz"), lambda: ws.save("foo://bucket/m.npz", WEIGHTS),
                 lambda: ws.latest("foo://runs"), lambda: ws.publish("foo://runs", WEIGHTS, step=1)):
        with pytest.raises(ws.StoreNotFoundError, match=r"foo://.*: foo:// is no storage weightstore knows") as caught:
            call()
        assert caught.value.path.startswith("foo://")
    result = subprocess.run([sys.executable, "-m", "weightstore", "ls", "foo://bucket/m.npz"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.startswith("error: foo://bucket/m.npz: foo:// is no storage")
    assert "internal error" not in result.stderr


# -- a LATEST that went back --------------------------------------------------------------------

def test_rolled_back_latest_never_costs_newer_versions(tmp_path):
    for step in (1, 2, 3, 4):
        ws.publish(tmp_path, weights_at(step), step=step, keep=None)
    restored = (tmp_path / "LATEST").read_bytes().replace(b"000000000004", b"000000000002").replace(
        b'"step": 4', b'"step": 2')
    (tmp_path / "LATEST").write_bytes(restored)  # a LATEST restored from an older backup
    assert ws.latest(tmp_path).step == 2
    before = names(tmp_path)
    with pytest.raises(ws.PublishError, match=r"step 3 is not after step 4: LATEST names step 2, but steps 3, 4 "
                                              r"above it were published before \(was LATEST restored"):
        ws.publish(tmp_path, weights_at(3), step=3, keep=None)
    assert names(tmp_path) == before
    np.testing.assert_array_equal(ws.load(tmp_path / "step-000000000004.npz")["w"], weights_at(4)["w"])
    ws.publish(tmp_path, weights_at(5), step=5, keep=None)  # going past them keeps them all
    assert [e.step for e in versions.list_versions(tmp_path)] == [1, 2, 3, 4, 5]


def test_rolled_back_latest_with_retention_still_refuses_going_back(tmp_path):
    for step in (1, 2, 3):
        ws.publish(tmp_path, weights_at(step), step=step, keep=2)
    pointer = json.loads((tmp_path / "LATEST").read_text())
    pointer.update(step=2, file="step-000000000002.npz")
    (tmp_path / "LATEST").write_text(json.dumps(pointer))
    with pytest.raises(ws.PublishError, match="step 3 above it was published before"):
        ws.publish(tmp_path, weights_at(3), step=3, keep=2)
    assert [e.step for e in versions.list_versions(tmp_path)] == [2, 3]


# -- a LATEST that is not a file ----------------------------------------------------------------

LATEST_READER = textwrap.dedent("""
    import sys
    import weightstore as ws
    try:
        ws.latest(sys.argv[1])
    except ws.FormatError as exc:
        print(exc)
""")


def test_latest_that_is_a_fifo_is_reported_not_waited_on(tmp_path):
    ws.publish(tmp_path, weights_at(1), step=1)
    os.unlink(tmp_path / "LATEST")
    os.mkfifo(tmp_path / "LATEST")
    result = subprocess.run([sys.executable, "-c", LATEST_READER, str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert "LATEST is a FIFO, not a file; the next publish replaces it" in result.stdout, result.stderr
    with pytest.raises(ws.FormatError, match="LATEST is a FIFO"):
        next(ws.follow(tmp_path, timeout=0))
    with pytest.warns(UserWarning, match="LATEST is a FIFO"):
        ws.publish(tmp_path, weights_at(2), step=2)
    assert ws.latest(tmp_path).step == 2 and (tmp_path / "LATEST").is_file()


def test_latest_that_is_an_empty_folder_is_repaired_by_the_next_publish(tmp_path):
    ws.publish(tmp_path, weights_at(1), step=1)
    os.unlink(tmp_path / "LATEST")
    (tmp_path / "LATEST").mkdir()
    with pytest.raises(ws.FormatError, match="LATEST is a folder, not a file"):
        ws.latest(tmp_path)
    with pytest.warns(UserWarning, match="LATEST is a folder"):
        ws.publish(tmp_path, weights_at(2), step=2)
    assert ws.latest(tmp_path).step == 2


def test_latest_that_is_a_folder_with_files_is_refused_not_deleted(tmp_path):
    ws.publish(tmp_path, weights_at(1), step=1)
    os.unlink(tmp_path / "LATEST")
    (tmp_path / "LATEST").mkdir()
    (tmp_path / "LATEST" / "notes.txt").write_text("keep me")
    with pytest.warns(UserWarning), pytest.raises(ws.TargetError, match="LATEST is a folder with files in it"):
        ws.publish(tmp_path, weights_at(2), step=2)
    assert (tmp_path / "LATEST" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("content", [
    b"[" * 100_000 + b"]" * 100_000,                                      # nested past the recursion limit
    b'{"format": "weightstore-latest", "step": ' + b"9" * 5000 + b', "file": "x"}',  # past int's digit limit
    b'{"format": "weightstore-latest", "step": true, "file": "step-000000000001.npz"}',
    b"\xff\xfe",
])
def test_damaged_latest_is_a_format_error_and_publish_repairs_it(tmp_path, content):
    ws.publish(tmp_path, weights_at(1), step=1)
    (tmp_path / "LATEST").write_bytes(content)
    with pytest.raises(ws.FormatError, match="LATEST is not a weightstore version pointer"):
        ws.latest(tmp_path)
    with pytest.warns(UserWarning, match="the next publish replaces it"):
        ws.publish(tmp_path, weights_at(2), step=2)
    assert ws.latest(tmp_path).step == 2


# -- a version a user holds ---------------------------------------------------------------------

def test_store_opened_from_a_pinned_version_outlives_the_pin(tmp_path):
    ws.publish(tmp_path, weights_at(1), step=1, keep=2)
    following = ws.follow(tmp_path, timeout=0)
    version = next(following)
    held = ws.open(version)
    for step in (2, 3, 4):  # version 1 is pruned from the folder
        ws.publish(tmp_path, weights_at(step), step=step, keep=2)
    assert [v.step for v in following] == [4]  # the iteration moved on and released its pin
    assert not (tmp_path / "step-000000000001.npz").exists()
    np.testing.assert_array_equal(held["w"], weights_at(1)["w"])
    held.close()
    with pytest.raises(ws.VersionGoneError, match="version 1 is gone"):
        ws.load(version)


def test_concurrent_open_and_release_of_a_pin_never_leaks_a_closed_reader(tmp_path):
    ws.publish(tmp_path, weights_at(1), step=1)
    errors = []
    for _ in range(20):
        version = next(ws.follow(tmp_path, timeout=0))

        def read(v=version):
            try:
                with ws.open(v) as store:
                    store["w"]
            except ws.WeightStoreError:
                pass  # gone is a fair answer; a ValueError is not
            except Exception as exc:  # noqa: BLE001 - the test is that nothing else comes out
                errors.append(exc)

        thread = threading.Thread(target=read)
        thread.start()
        version.release()
        thread.join()
    assert errors == []


# -- reading what is not a regular file ---------------------------------------------------------

FIFO_READER = textwrap.dedent("""
    import sys
    import weightstore as ws
    try:
        getattr(ws, sys.argv[1])(sys.argv[2])
    except ws.WeightStoreError as exc:
        print(type(exc).__name__, exc.path, exc, sep="|")
""")


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors", ".keras", ""])
@pytest.mark.parametrize("call", ["open", "load"])
def test_reading_a_fifo_is_refused_not_waited_on(tmp_path, call, suffix):
    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    result = subprocess.run([sys.executable, "-c", FIFO_READER, call, str(fifo)], capture_output=True, text=True,
                            timeout=60)
    kind, path, message = result.stdout.strip().split("|")
    assert (kind, path) == ("FormatError", str(fifo)), result.stderr
    assert "is not a regular file (a FIFO)" in message


def test_ws_ls_of_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    result = subprocess.run([sys.executable, "-m", "weightstore", "ls", str(fifo)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert f"{fifo}: is not a regular file (a FIFO)" in result.stderr


UNLISTABLE_READER = textwrap.dedent("""
    import sys
    import weightstore as ws
    from weightstore.formats.tf_checkpoint import resolve_prefix  # the TF adapters' and ws import --into's
    for call in (ws.open, ws.load, resolve_prefix):
        try:
            call(sys.argv[1])
        except ws.WeightStoreError as exc:
            print(type(exc).__name__, exc, sep="|")
""")


def test_a_folder_that_may_not_be_listed_is_refused_naming_it(tmp_path):
    """A folder the user may enter but not list (mode 0o300, a drop box) given as a weight file:
    the format finders' listing of it, and the check whether it is empty, raised the system's
    PermissionError, a bare OSError naming nothing weightstore took."""
    folder = tmp_path / "drop"
    folder.mkdir(mode=0o300)
    command = [sys.executable, "-c", UNLISTABLE_READER, str(folder)]
    if os.geteuid() == 0:  # root lists any folder; without the two capabilities that let it, as a user would
        if shutil.which("setpriv") is None:
            pytest.skip("run as root, and no setpriv to drop the capabilities that skip permission checks")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"FileAccessError|{folder}: cannot be listed (Permission denied)"] * 2 + [
        f"StoreNotFoundError|{folder}: is a folder, not a weight file, and holds no TF checkpoint "
        "(no 'checkpoint' state file, no .index file)"]


def test_reading_a_device_is_refused(tmp_path):
    with pytest.raises(ws.FormatError, match=r"/dev/zero: is not a regular file \(a character device\)"):
        ws.open("/dev/zero", format="npz")


# -- the index-last commit of a TF checkpoint, without TensorFlow ------------------------------

def write_fake_checkpoint(prefix: str, shards: int, content: bytes) -> None:
    """What TensorFlow's SaveV2 leaves at ``prefix``: data files named by the shard count, then the index."""
    for shard in range(shards):
        with open(f"{prefix}.data-{shard:05d}-of-{shards:05d}", "wb") as handle:
            handle.write(content)
    with open(f"{prefix}.index", "wb") as handle:
        handle.write(b"index of " + content)


def test_index_last_commit_writes_fresh_data_names_and_swaps_the_index_last(tmp_path):
    from weightstore.io.commit import IndexLastCommit

    prefix = str(tmp_path / "m.ckpt")
    first = IndexLastCommit(prefix, entries=2)
    with first.writing() as temporary:
        write_fake_checkpoint(temporary, first.shards, b"old")
    assert names(tmp_path) == ["m.ckpt.data-00000-of-00001", "m.ckpt.index"]
    second = IndexLastCommit(prefix, entries=2)
    with second.writing() as temporary:
        assert second.shards == 2  # a count no data file at the prefix has: names the old index never reads
        write_fake_checkpoint(temporary, second.shards, b"new")
    assert names(tmp_path) == ["m.ckpt.data-00000-of-00002", "m.ckpt.data-00001-of-00002", "m.ckpt.index"]
    assert (tmp_path / "m.ckpt.index").read_bytes() == b"index of new"


def test_index_last_commit_that_fails_leaves_the_old_checkpoint_alone(tmp_path):
    from weightstore.io.commit import IndexLastCommit

    prefix = str(tmp_path / "m.ckpt")
    with IndexLastCommit(prefix, entries=1).writing() as temporary:
        write_fake_checkpoint(temporary, 1, b"old")
    before = {name: (tmp_path / name).read_bytes() for name in names(tmp_path)}
    commit = IndexLastCommit(prefix, entries=3)
    with pytest.raises(OSError, match="disk full"), commit.writing() as temporary:
        write_fake_checkpoint(temporary, commit.shards, b"new")
        raise OSError("disk full")
    assert {name: (tmp_path / name).read_bytes() for name in names(tmp_path)} == before
