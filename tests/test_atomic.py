"""Atomic writes: a failed, refused or killed save leaves the previous file byte for byte."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import weightstore as ws
from in_turn import ws_in_turn
from polling import wait_until
from weightstore.formats import hdf5, npz
from weightstore.io import files
from weightstore.io.files import TEMP_MARK

SUFFIXES = [".npz", ".h5"]
WRITERS = {".npz": npz.NpzWriter, ".h5": hdf5.Hdf5Writer}


def previous(tmp_path, suffix):
    path = tmp_path / f"w{suffix}"
    ws.save(path, {"old/w": np.arange(100, dtype=np.float32)}, metadata={"v": 1})
    return path, path.read_bytes()


def leftovers(folder, path):
    return sorted(name for name in os.listdir(folder) if name != path.name)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_failure_mid_write_leaves_previous_file(tmp_path, suffix, monkeypatch):
    path, before = previous(tmp_path, suffix)
    writer = WRITERS[suffix]
    original = writer.add
    seen = []

    def add(self, key, dtype_name, data):
        if seen:
            # The first tensor is already in the temporary file beside the target.
            temporaries = leftovers(tmp_path, path)
            assert len(temporaries) == 1 and (tmp_path / temporaries[0]).stat().st_size > 0
            raise OSError(28, "No space left on device (simulated)")
        seen.append(key)
        return original(self, key, dtype_name, data)

    monkeypatch.setattr(writer, "add", add)
    with pytest.raises(OSError, match="No space left"):
        ws.save(path, {"new/a": np.ones((512, 512)), "new/b": np.ones(10)})  # 2 MB: past any write buffering
    assert seen == ["new/a"]
    assert path.read_bytes() == before
    assert leftovers(tmp_path, path) == []


_FILL_DISK = """
import resource, signal, sys
import numpy as np
import weightstore as ws
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # exceed the limit -> EFBIG, not death
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    ws.save(sys.argv[1], {"a": np.ones(1 << 18, np.float32), "b": np.ones(1 << 20, np.float32)})
except OSError as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
"""


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_real_write_error_leaves_previous_file(tmp_path, suffix):
    """The file system refuses the write half-way (file size limit): a genuine I/O error, naming
    the file the caller gave, never the temporary beside it that the save was writing."""
    path, before = previous(tmp_path, suffix)
    result = subprocess.run([sys.executable, "-c", _FILL_DISK, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.startswith(f"WriteError {path}: "), result.stdout
    assert path.read_bytes() == before
    assert leftovers(tmp_path, path) == []
    assert np.array_equal(ws.load(path)["old/w"], np.arange(100, dtype=np.float32))


@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("bad", [
    {"ok": np.zeros(3), "also/ok": np.zeros(3), "bad//key": np.zeros(3)},
    {"ok": np.zeros(3), "objects": np.array([None, 1], dtype=object)},
    {"ok": np.zeros(3), "text": np.array(["a", "b"])},
], ids=["invalid-key", "object-array", "strings"])
def test_refused_input_after_valid_tensors_writes_nothing(tmp_path, suffix, bad):
    path, before = previous(tmp_path, suffix)
    with pytest.raises(ws.WeightStoreError):
        ws.save(path, bad)
    assert path.read_bytes() == before
    assert leftovers(tmp_path, path) == []


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_unserializable_metadata_writes_nothing(tmp_path, suffix):
    path, before = previous(tmp_path, suffix)
    with pytest.raises(TypeError):
        ws.save(path, {"w": np.zeros(3)}, metadata={"f": open})
    assert path.read_bytes() == before
    assert leftovers(tmp_path, path) == []


_SLOW_WRITER = """
import sys
import numpy as np
import weightstore as ws
weights = {f"layer_{i:02d}/kernel": np.full(5 << 20, i, np.float32) for i in range(10)}  # 200 MB
print("ready", flush=True)
ws.save(sys.argv[1], weights)
print("done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_sigkill_mid_write_leaves_previous_file_and_next_save_cleans_up(tmp_path, suffix):
    path, before = previous(tmp_path, suffix)
    for _attempt in range(3):
        child = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            temporary = _wait_for_growing_temporary(tmp_path, path, child, 16 << 20)
            if temporary is not None:
                os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=30)
        if temporary is not None and child.returncode == -signal.SIGKILL:
            break
        ws.save(path, {"old/w": np.arange(100, dtype=np.float32)}, metadata={"v": 1})  # it finished first: again
        before = path.read_bytes()
    else:
        pytest.fail("the writer finished before it could be killed three times")
    assert path.read_bytes() == before
    assert np.array_equal(ws.load(path)["old/w"], np.arange(100, dtype=np.float32))
    assert leftovers(tmp_path, path) == [temporary]  # a kill leaves its temporary behind ...
    assert (tmp_path / temporary).stat().st_size < 200 << 20
    ws.save(path, {"next": np.zeros(2)})  # ... and the next save to that target removes it
    assert leftovers(tmp_path, path) == []
    assert list(ws.load(path)) == ["next"]


def _wait_for_growing_temporary(folder, path, child, size):
    """The name of the writer's temporary once it holds ``size`` bytes; None if the writer ended."""
    def grown() -> tuple[str | None] | None:
        if child.poll() is not None:
            return (None,)
        for name in leftovers(folder, path):
            with contextlib.suppress(FileNotFoundError):
                if os.stat(folder / name).st_size >= size:
                    return (name,)
        return None

    return wait_until(grown, what="the writer's temporary file", every=0.0005)[0]


def _dead_pid():
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(ended.stdout)


def test_temporaries_of_live_writers_are_left_alone(tmp_path):
    """Temporaries named by this PID namespace, or by older weightstore (no namespace), go once
    their PID is dead; a live writer's (this process's, writing it), or another target's, stay."""
    path = tmp_path / "w.npz"
    dead_pid, space = _dead_pid(), files.pid_space()
    live = files.temporary_beside(path)
    dead = tmp_path / f".w.npz.wstmp-{dead_pid}-{space}-4567cdef"
    live_older = tmp_path / f".w.npz.wstmp-{os.getpid()}-0123abcd"
    dead_older = tmp_path / f".w.npz.wstmp-{dead_pid}-4567cdef"
    other_target = tmp_path / f".other.npz.wstmp-{dead_pid}-{space}-89abcdef"
    for leftover in (live, dead, live_older, dead_older, other_target):
        leftover.write_bytes(b"partial")
    ws.save(path, {"w": np.zeros(2)})
    assert live.exists() and live_older.exists() and other_target.exists()
    assert not dead.exists() and not dead_older.exists()
    files.temporary_done(live)  # its write over, as a writer says: the name is noted no longer


def test_a_temporary_named_by_this_very_process_that_it_is_not_writing_goes(tmp_path, monkeypatch):
    """A container's trainer is often PID 1, and a restarted container's PID namespace may get the
    inode of its killed one, so the same space: the temporary the killed trainer's save left is
    named by this process's own PID and space. This process is not writing it, so the next save
    removes it; another thread's save of the same target, under way meanwhile, keeps its own and
    commits."""
    path = tmp_path / "w.npz"
    left = tmp_path / f".w.npz.wstmp-{os.getpid()}-{files.pid_space()}-0123abcd"  # the killed earlier PID 1's
    left.write_bytes(b"partial")
    ws.save(path, {"w": np.arange(3.0)})
    assert not left.exists() and leftovers(tmp_path, path) == []
    assert ws.load(path)["w"].tolist() == [0, 1, 2]

    original, reached, go_on = npz.NpzWriter.add, threading.Event(), threading.Event()

    def add(self, key, dtype_name, data):  # the thread's save waits half-written, its temporary there
        if key == "theirs/b":
            reached.set()
            go_on.wait(60)
        return original(self, key, dtype_name, data)

    monkeypatch.setattr(npz.NpzWriter, "add", add)
    theirs = {"theirs/a": np.ones((512, 512)), "theirs/b": np.full(4, 7.0)}  # 2 MB first: past any buffering
    writer = threading.Thread(target=ws.save, args=(path, theirs))
    writer.start()
    try:
        assert reached.wait(60)
        (writing,) = leftovers(tmp_path, path)
        left.write_bytes(b"partial")
        ws.save(path, {"here": np.zeros(2)})
        assert not left.exists() and (tmp_path / writing).exists()
    finally:
        go_on.set()
        writer.join(60)
    loaded = ws.load(path)  # the thread's save committed, last
    assert sorted(loaded) == sorted(theirs) and all(np.array_equal(loaded[k], v) for k, v in theirs.items())
    assert leftovers(tmp_path, path) == []


def test_where_no_pid_namespace_can_be_read_a_temporary_of_this_pid_stays(tmp_path, monkeypatch):
    """Where ``/proc`` cannot tell PID namespaces apart, temporaries name the host's space, which
    every container on the host shares: another container's trainer, PID 1 as this one is, may be
    writing the temporary its PID names, so it is not taken for this process's dead predecessor's."""
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if os.fspath(path) == "/proc/self/ns/pid":
            raise PermissionError(13, "Permission denied", path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(files, "_OWN_SPACE", None)
    monkeypatch.setattr(os, "stat", stat)
    assert files.pid_space() == files._host_space()
    path = tmp_path / "w.npz"
    theirs = tmp_path / f".w.npz.wstmp-{os.getpid()}-{files.pid_space()}-0123abcd"  # another container's PID 1
    theirs.write_bytes(b"being written")
    ws.save(path, {"w": np.arange(3.0)})
    assert theirs.exists() and ws.load(path)["w"].tolist() == [0, 1, 2]


def test_a_temporary_left_in_a_folder_untouched_since_the_last_save_goes_within_the_minute(tmp_path, monkeypatch):
    """A process saving one target again lists its folder only once something changed there
    since its last save of it: a dead writer's temporary begun while that save ran (the folder's
    time as that save left it) stays until the minute passes, then goes with the next save."""
    path = tmp_path / "w.npz"
    ws.save(path, {"w": np.zeros(2)})
    ws.save(path, {"w": np.ones(2)})
    seen = os.stat(tmp_path)
    dead = tmp_path / f".w.npz.wstmp-{_dead_pid()}-{files.pid_space()}-4567cdef"
    dead.write_bytes(b"partial")
    os.utime(tmp_path, ns=(seen.st_atime_ns, seen.st_mtime_ns))
    ws.save(path, {"w": np.full(2, 2.0)})
    assert dead.exists()
    monkeypatch.setattr(files, "SWEEP_AGAIN_AFTER", 0.0)
    ws.save(path, {"w": np.full(2, 3.0)})
    assert not dead.exists()
    assert ws.load(path)["w"].tolist() == [3, 3]


def test_temporaries_of_another_pid_namespace_go_only_once_untouched_for_a_day(tmp_path):
    """Another namespace's PID means nothing here (dead here, its writer may be writing): its
    temporary stays while its mtime is recent, and goes once it has not moved for STALE_AFTER."""
    path = tmp_path / "w.npz"
    elsewhere = "0" * 12 if files.pid_space() != "0" * 12 else "1" * 12
    fresh = tmp_path / f".w.npz.wstmp-{_dead_pid()}-{elsewhere}-0123abcd"
    old = tmp_path / f".w.npz.wstmp-{_dead_pid()}-{elsewhere}-4567cdef"
    for leftover in (fresh, old):
        leftover.write_bytes(b"partial")
    long_ago = time.time() - files.STALE_AFTER - 60
    os.utime(old, (long_ago, long_ago))
    ws.save(path, {"w": np.zeros(2)})
    assert fresh.exists() and not old.exists()
    assert list(ws.load(path)) == ["w"]


def test_a_scratch_folder_is_made_after_removing_dead_writers_ones_and_nothing_else(tmp_path, monkeypatch):
    """An upload's or an unpacked archive's scratch folder in ``TMPDIR`` is named by its writer as
    a temporary is: a process's first one removes those of dead writers of this namespace, and
    keeps a live writer's, another namespace's still in use, and what is not such a folder (a
    file, a link to a folder elsewhere: never followed)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(files, "_SCRATCH_SWEPT", set())
    head, space, dead_pid = "weightstore-upload-", files.pid_space(), _dead_pid()
    elsewhere = "0" * 12 if space != "0" * 12 else "1" * 12
    dead, live, other = (tmp_path / f"{head}{pid}-{named}-k_07lpue" for pid, named in
                         ((dead_pid, space), (os.getppid(), space), (dead_pid, elsewhere)))
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "upload.npz").write_bytes(b"partial")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_bytes(b"mine")
    link, file = tmp_path / f"{head}{dead_pid}-{space}-linked12", tmp_path / f"{head}{dead_pid}-{space}-afile123"
    link.symlink_to(outside, target_is_directory=True)
    file.write_bytes(b"not a folder")
    made = Path(files.scratch_folder(head))
    assert made.parent == tmp_path and made.name.startswith(f"{head}{os.getpid()}-{space}-") and made.is_dir()
    assert not dead.exists()
    assert (live / "upload.npz").exists() and (other / "upload.npz").exists()
    assert link.is_symlink() and (outside / "kept").read_bytes() == b"mine" and file.read_bytes() == b"not a folder"


def test_a_scratch_folder_named_by_this_very_process_that_it_did_not_make_goes(tmp_path, monkeypatch):
    """A container's trainer is often PID 1, and a restarted container's PID namespace may get the
    inode of its killed one (the kernel hands out the lowest free one), so the same space: the
    folder the killed trainer left is named by this process's own PID and space. It is an earlier
    process's, not this one's, and goes; the one this process made (another thread's upload)
    stays."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(files, "_SCRATCH_SWEPT", set())
    head = "weightstore-upload-"
    mine = Path(files.scratch_folder(head))
    (mine / "upload.npz").write_bytes(b"being uploaded")
    left = tmp_path / f"{head}{os.getpid()}-{files.pid_space()}-k_07lpue"  # the killed earlier PID 1's
    left.mkdir()
    (left / "upload.npz").write_bytes(b"partial")
    monkeypatch.setattr(files, "_SCRATCH_SWEPT", set())  # the next upload of this process looks again
    made = Path(files.scratch_folder(head))
    try:
        assert not left.exists()
        assert (mine / "upload.npz").read_bytes() == b"being uploaded" and made.is_dir()
    finally:
        files.remove_scratch(str(mine))
        files.remove_scratch(str(made))
    assert sorted(tmp_path.iterdir()) == []


_WRITER_ELSEWHERE = """
import json, os, sys
from weightstore.io.commit import RenameCommit
target, alive_here = sys.argv[1], set(json.loads(sys.argv[2]))
while True:  # PIDs here count up from 2: the writer takes the first one that is dead in the test's namespace
    pid = os.fork()
    if pid == 0:
        if os.getpid() in alive_here:
            os._exit(3)
        with RenameCommit(target).writing() as local:
            with open(local, "wb") as handle:
                handle.write(open(sys.argv[3], "rb").read())
            print(os.getpid(), local, flush=True)
            sys.stdin.readline()  # the other namespace saves the same target meanwhile
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code != 3:
        sys.exit(code)
"""


def test_a_live_writer_in_another_pid_namespace_keeps_its_temporary(tmp_path):
    """A container on a shared volume: its writer's PID is dead here, yet its save of the same
    target, going on beside one of ours, commits."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "-Upf", "--mount-proc", "true"],
                                                      capture_output=True).returncode:
        pytest.skip("no unshare, or unshare -Upf --mount-proc refused here (no unprivileged user namespaces)")
    path, theirs = tmp_path / "w.npz", tmp_path / "theirs.npz"
    ws.save(theirs, {"there": np.ones(3)})
    alive_here = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    writer = subprocess.Popen(["unshare", "-Upf", "--mount-proc", sys.executable, "-c", _WRITER_ELSEWHERE, str(path),
                               json.dumps(alive_here), str(theirs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    _save_beside_a_live_writer(writer, path)
    assert list(ws.load(path)) == ["there"]  # its save committed last
    assert leftovers(tmp_path, path) == ["theirs.npz"]


def _save_beside_a_live_writer(writer: subprocess.Popen, path) -> None:
    """Save ``path`` while ``writer`` (another PID namespace's process, which printed its PID and
    its temporary of ``path``) still writes: its PID is nobody's here, so the PID rule alone would
    remove its temporary; it must survive, and the writer then commits."""
    try:
        pid, temporary = writer.stdout.readline().split()
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
        ws.save(path, {"here": np.zeros(2)})
        assert os.path.exists(temporary)
        writer.stdin.write("go on\n")
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
        writer.wait()


_FORKED_INTO_A_NEW_NAMESPACE = """
import ctypes, json, os, sys
from weightstore.io import files
from weightstore.io.files import TEMP_MARK
target, alive_here = sys.argv[1], set(json.loads(sys.argv[2]))
files.temporary_beside(files.Path(target))  # the parent's space, asked before
if ctypes.CDLL(None, use_errno=True).unshare(0x20000000):  # CLONE_NEWPID: for the children forked from now on
    sys.exit(5)
if os.fork():
    sys.exit(os.waitstatus_to_exitcode(os.wait()[1]))
while True:  # the namespace's init (PID 1) forks writers until one has a PID dead in the test's namespace
    pid = os.fork()
    if pid == 0:
        if os.getpid() in alive_here:
            os._exit(3)
        temporary = files.temporary_beside(files.Path(target))
        temporary.write_bytes(b"partial")
        print(os.getpid(), temporary, flush=True)
        sys.stdin.readline()
        os._exit(0 if temporary.exists() else 4)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code != 3:
        os._exit(code)
"""


def test_a_writer_forked_into_a_new_pid_namespace_names_its_own(tmp_path):
    """A process that asked for its space, then forked a writer into a new PID namespace: the
    writer's PID is dead here, and its temporary must not name this namespace, or a save here
    removes it while it writes."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode:
        pytest.skip("no unshare, or unshare -Ur refused here (no unprivileged user namespaces)")
    path = tmp_path / "w.npz"
    alive_here = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    writer = subprocess.Popen(["unshare", "-Ur", sys.executable, "-c", _FORKED_INTO_A_NEW_NAMESPACE, str(path),
                               json.dumps(alive_here)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    _save_beside_a_live_writer(writer, path)


def test_without_proc_every_process_of_a_host_names_the_same_space(tmp_path):
    """Where no PID namespace can be read (macOS), the host's space: a killed writer's temporary
    goes with the next save (the PID rule), not a day later."""
    without_proc = ("import os, sys; from weightstore.io import files; stat = os.stat\n"
                    "def no_proc(path, *a, **k):\n"
                    "    if str(path).startswith('/proc'): raise FileNotFoundError(path)\n"
                    "    return stat(path, *a, **k)\n"
                    "files.os.stat = no_proc\n")
    killed = subprocess.run([sys.executable, "-c", without_proc + "t = files.temporary_beside(files.Path(sys.argv[1]));"
                             " t.write_bytes(b'partial'); print(t)", str(tmp_path / "w.npz")],
                            capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-c", without_proc + "import numpy, weightstore as ws;"
                    " ws.save(sys.argv[1], {'w': numpy.zeros(2)})", str(tmp_path / "w.npz")], check=True)
    assert not os.path.exists(killed)
    assert os.listdir(tmp_path) == ["w.npz"]


@pytest.mark.parametrize("length", [222, 254, 255])
def test_a_name_as_long_as_a_file_system_allows_saves(tmp_path, length):
    """The temporary of a long name is a shortened name plus a hash of it, under the 255 bytes a
    file system allows, and a killed writer's is still found by the next save."""
    path = tmp_path / ("é" * 10 + "a" * (length - 24) + ".npz")
    assert len(path.name.encode()) == length
    dead = files.temporary_beside(path)
    dead = dead.with_name(dead.name.replace(f"{TEMP_MARK}{os.getpid()}-", f"{TEMP_MARK}{_dead_pid()}-"))
    dead.write_bytes(b"partial")
    assert len(dead.name.encode()) <= 255
    ws.save(path, {"w": np.zeros(2)})
    ws.save(path, {"w": np.ones(2)})
    assert ws.load(path)["w"].tolist() == [1, 1]
    assert leftovers(tmp_path, path) == []


def test_a_name_longer_than_a_file_system_allows_is_refused_naming_it(tmp_path):
    path = tmp_path / ("a" * 252 + ".npz")
    with pytest.raises(ws.TargetError) as info:
        ws.save(path, {"w": np.zeros(2)})
    assert str(path) in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_overwrite_false_refuses_an_existing_file(tmp_path, suffix):
    path, before = previous(tmp_path, suffix)
    with pytest.raises(ws.StoreExistsError) as info:
        ws.save(path, {"w": np.zeros(2)}, overwrite=False)
    assert str(path) in str(info.value)
    assert isinstance(info.value, FileExistsError)
    assert path.read_bytes() == before
    assert leftovers(tmp_path, path) == []
    fresh = tmp_path / f"fresh{suffix}"
    ws.save(fresh, {"w": np.zeros(2)}, overwrite=False)
    assert list(ws.load(fresh)) == ["w"]


def test_overwrite_true_replaces(tmp_path):
    path, before = previous(tmp_path, ".npz")
    ws.save(path, {"w": np.ones(2)})
    assert path.read_bytes() != before
    assert list(ws.load(path)) == ["w"]
    assert leftovers(tmp_path, path) == []


def test_save_into_a_missing_folder(tmp_path):
    path = tmp_path / "no" / "such" / "folder" / "w.npz"
    with pytest.raises(ws.StoreNotFoundError) as info:
        ws.save(path, {"w": np.zeros(2)})
    assert str(path) in str(info.value)
    assert not (tmp_path / "no").exists()


def test_replaced_file_is_complete_for_an_open_reader(tmp_path):
    """A store opened before a save keeps reading the old file; a new open sees the new one."""
    path = tmp_path / "w.h5"
    ws.save(path, {"w": np.arange(10)})
    with ws.open(path) as old:
        ws.save(path, {"w": np.arange(10) * 2, "extra": np.zeros(1)})
        assert np.array_equal(old["w"], np.arange(10))
        with ws.open(path) as new:
            assert np.array_equal(new["w"], np.arange(10) * 2)
            assert list(new.keys()) == ["w", "extra"]


_WS_UNDER_A_FILE_SIZE_LIMIT = ("import resource, runpy, signal, sys\n"
                               "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
                               "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
                               "sys.argv[0] = 'ws'\n"
                               "runpy.run_module('weightstore', run_name='__main__')\n")


def ws_under_a_file_size_limit(*args, timeout=60):
    """The real ``ws`` command in a process of its own whose writes past 1 MB fail (EFBIG)."""
    return subprocess.run([sys.executable, "-c", _WS_UNDER_A_FILE_SIZE_LIMIT, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ws_imports_into_checkpoints(tmp_path_factory):
    """``ws import`` into TF checkpoints, its writes past 1 MB refused: into ``m.ckpt``; into
    ``run/a/m.ckpt`` and ``kept/new/m.ckpt``, whose folders it makes (``kept`` was there); into a
    prefix of 180 bytes (16 bytes written). The folder of each case, and each target with the
    (status, stdout, stderr) of its ``ws import``."""
    pytest.importorskip("tensorflow")
    folders = {name: tmp_path_factory.mktemp(name) for name in ("alone", "folders", "long")}
    for name in ("alone", "folders"):
        ws.save(folders[name] / "w.npz", {"a": np.ones(1 << 19, np.float32)})
    ws.save(folders["long"] / "w.npz", {"a": np.arange(4, dtype=np.float32)})
    (folders["folders"] / "kept").mkdir()
    targets = {"alone": [folders["alone"] / "m.ckpt"],
               "folders": [folders["folders"] / "run" / "a" / "m.ckpt", folders["folders"] / "kept" / "new" / "m.ckpt"],
               "long": [folders["long"] / ("m" * 175 + ".ckpt")]}
    commands = [["import", folders[name] / "w.npz", "--into", target] for name in targets for target in targets[name]]
    done = iter(ws_in_turn(commands, file_size_limit=1 << 20))  # TensorFlow imported once for the four
    return {name: (folders[name], [(target, next(done)) for target in targets[name]]) for name in targets}


def test_ws_import_into_a_checkpoint_past_a_file_size_limit_leaves_nothing_and_says_why(ws_imports_into_checkpoints):
    """Found as a user: TensorFlow's SaveV2 writes its data file as ``….tempstateN`` and leaves it
    when the write fails; that file, as large as the data written, stayed hidden beside the
    checkpoint, and the error named it with TensorFlow's op in braces. The real ws, its writes
    past 1 MB refused."""
    folder, [(target, done)] = ws_imports_into_checkpoints["alone"]
    assert done == (1, "", f"error: {target}: TensorFlow could not write the checkpoint: File too large\n")
    assert sorted(os.listdir(folder)) == ["w.npz"]


def test_ws_import_into_a_new_checkpoint_folder_that_fails_leaves_no_folder(ws_imports_into_checkpoints):
    """``ws import --into run/a/m.ckpt`` makes the prefix's folders; a write that failed left them,
    empty, where the failure was to leave nothing. A folder already there stays."""
    folder, runs = ws_imports_into_checkpoints["folders"]
    for target, done in runs:
        assert done == (1, "", f"error: {target}: TensorFlow could not write the checkpoint: File too large\n")
    assert sorted(os.listdir(folder)) == ["kept", "w.npz"] and os.listdir(folder / "kept") == []


def test_ws_import_into_a_checkpoint_of_a_name_tensorflow_writes_writes_it(ws_imports_into_checkpoints):
    """A prefix of 180 bytes, which TensorFlow's own save writes: the temporary prefix left room
    for weightstore's endings but not for the ``.tempstateN`` (up to 20 digits) SaveV2 appends to
    its data file, so the import failed with "File name too long"."""
    _, [(prefix, (status, _, stderr))] = ws_imports_into_checkpoints["long"]
    assert status == 0, stderr
    assert ws.load(prefix)["a"].tolist() == [0, 1, 2, 3]


def test_ws_convert_to_hdf5_past_a_file_size_limit_says_why_in_words(tmp_path):
    """Found as a user: an HDF5 write the file system refused printed HDF5's own line,
    "[Errno 27] Can't synchronously write data (file write failed: time = ...", where npz and
    safetensors say "File too large" (or "No space left on device"). The real ws, its writes
    past 1 MB refused; nothing is left."""
    source = tmp_path / "w.npz"
    ws.save(source, {"a": np.ones(1 << 19, np.float32)})
    done = ws_under_a_file_size_limit("convert", source, tmp_path / "out.h5")
    assert done.returncode == 1
    assert done.stderr == f"error: {tmp_path / 'out.h5'}: tensor 'a': writing HDF5 failed: File too large\n"
    assert sorted(os.listdir(tmp_path)) == ["w.npz"]
