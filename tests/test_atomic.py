"""Atomic writes: a failed, refused or killed save leaves the previous file byte for byte."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import weightstore as ws
from polling import wait_until
from weightstore.formats import hdf5, npz
from weightstore.io._writeback import behind

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
    """The file system refuses the write half-way (file size limit): a genuine I/O error."""
    path, before = previous(tmp_path, suffix)
    result = subprocess.run([sys.executable, "-c", _FILL_DISK, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
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
    behind(int).result()  # (on the writeback thread: wait for it)
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


def test_temporaries_of_live_writers_are_left_alone(tmp_path):
    path = tmp_path / "w.npz"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(ended.stdout)
    live = tmp_path / f".w.npz.wstmp-{os.getpid()}-0123abcd"
    dead = tmp_path / f".w.npz.wstmp-{dead_pid}-4567cdef"
    other_target = tmp_path / f".other.npz.wstmp-{dead_pid}-89abcdef"
    for leftover in (live, dead, other_target):
        leftover.write_bytes(b"partial")
    ws.save(path, {"w": np.zeros(2)})
    behind(int).result()  # the save looks for stale temporaries on the writeback thread
    assert live.exists() and other_target.exists()
    assert not dead.exists()


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
