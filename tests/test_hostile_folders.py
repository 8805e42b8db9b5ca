"""Hostile versioned folders, property-based: a published folder (plain versions, a committed
sharded version, a dead attempt) whose files were swapped for symbolic links out of it, FIFOs,
folders or a user's bytes, whose ``LATEST`` names ``../``, odd characters or huge steps, and
beside whose attempt folders a user keeps folders of near names.

Every reader (``ws.latest``, ``ws.open`` of the version, one look of ``ws.follow``, ``ws ls``,
``ws verify``, ``ws versions``) returns or raises a WeightStoreError naming the folder's file,
and ``ws clean`` deletes nothing outside the folder and nothing weightstore did not write.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import weightstore as ws
from weightstore.cli.main import app

ATTEMPT_3 = "step-000000000003.attempt-0"
ATTEMPT_4 = "step-000000000004.attempt-0"
#: what a planting may replace: every kind of file and folder a versioned folder holds
PLANTED_AT = ["LATEST", "step-000000000002.npz", "step-000000000003.wsindex", ATTEMPT_3,
              f"{ATTEMPT_3}/rank-00000.safetensors", f"{ATTEMPT_3}/rank-00000.blocks", f"{ATTEMPT_3}/rank-00000.done",
              ATTEMPT_4, f"{ATTEMPT_4}/rank-00000.done"]
KINDS = ["link-to-file", "link-to-folder", "link-up", "link-loop", "fifo", "folder", "user-bytes", "user-file-in"]
#: what a hostile ``LATEST`` names (``file``, ``step``)
POINTED = st.tuples(
    st.sampled_from(["../outside/other.npz", "step-000000000002.npz\n", "step-00000000000\u0662.npz",
                     f"step-{10**200}.npz", f"step-{10**300}.npz", "step-000000000009.npz", "step-000000000002.npz",
                     "step-000000000003.wsindex", ".", "/etc/passwd"]),
    st.sampled_from([2, 3, 9, 10**200, 10**300, 2**63, -1]))
#: folders of names near an attempt folder's that a user keeps beside the versions
NEAR_NAMES = ["step-000000000003.attempt-0\n", "step-000000000004.attempt-00", "step-000000000004.attempt-mine",
              "step-000000000001.attempt-", "step-00000000004.attempt-0"]


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """Steps 1 and 2 (npz), 3 (sharded, committed: LATEST) and a dead attempt at step 4."""
    run = tmp_path_factory.mktemp("published") / "run"
    for step in (1, 2):
        ws.publish(run, {"w": np.full(4, step, np.float32)}, step=step)
    for step in (3, 4):
        ws.publish_shard(run, {"w": [ws.Piece(np.full(2, step, np.float32), (0,), (2,))]}, step=step, rank=0,
                         world=1, attempt=0)
    ws.commit_shards(run, step=3, world=1, attempt=0, timeout=10)
    return run


def plant(run: Path, outside: Path, where: str, kind: str) -> list[Path]:
    """Put ``kind`` at ``where`` in ``run``; the user's files it made (which must survive)."""
    path = run / where
    if kind == "user-file-in":
        if not path.is_dir() or path.is_symlink():
            return []
        (path / "notes.txt").write_text("the user's")
        return [path / "notes.txt"]
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if not path.parent.is_dir():
        return []
    if kind == "link-to-file":
        path.symlink_to(outside / "secret.txt")
    elif kind == "link-to-folder":
        path.symlink_to(outside)
    elif kind == "link-up":
        path.symlink_to("..")
    elif kind == "link-loop":
        path.symlink_to(path.name)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
        (path / "mine.txt").write_text("the user's")
        return [path / "mine.txt"]
    else:  # damage at a name weightstore writes: no user's file, which clean may remove
        path.write_bytes(b"the user's bytes")
    return []


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every file under ``folder`` with its bytes (a link: where it points), not following links."""
    found: dict[str, bytes | str] = {}
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            found[path] = os.readlink(path) if os.path.islink(path) else (
                Path(path).read_bytes() if os.path.isfile(path) else "special")
    return found


def refused_or_read(run: Path, call) -> None:
    """``call()`` returns, or raises a WeightStoreError naming a file of ``run``."""
    try:
        call()
    except ws.WeightStoreError as error:
        assert str(run) in str(error), error


def cli(run: Path, *args: str) -> str:
    """A ``ws`` verb: it succeeds, or refuses with a WeightStoreError naming a file of ``run``."""
    result = CliRunner().invoke(app, ["--debug", *args])  # --debug: what escapes is raised, not printed
    if isinstance(result.exception, ws.WeightStoreError):
        assert str(run) in str(result.exception), result.exception
    elif result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code in (0, 1), result.output
    return result.output


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(plantings=st.lists(st.tuples(st.sampled_from(PLANTED_AT), st.sampled_from(KINDS)), max_size=4),
       pointer=st.none() | POINTED, near=st.lists(st.sampled_from(NEAR_NAMES), unique=True, max_size=2))
def test_readers_refuse_a_hostile_folder_by_name_and_clean_removes_nothing_of_a_users(published, plantings,
                                                                                        pointer, near):
    with tempfile.TemporaryDirectory() as scratch:
        run, outside = Path(scratch) / "run", Path(scratch) / "outside"
        shutil.copytree(published, run, symlinks=True)
        outside.mkdir()
        (outside / "secret.txt").write_text("the user's secret")
        ws.save(outside / "other.npz", {"w": np.zeros(4, np.float32)})
        if pointer is not None:
            file, step = pointer
            (run / "LATEST").write_text(json.dumps({"format": "weightstore-latest", "version": 1, "step": step,
                                                    "file": file, "created": "", "metadata": {}}))
        users = [file for where, kind in plantings for file in plant(run, outside, where, kind)]
        for name in near:
            (run / name).mkdir()
            (run / name / "mine.txt").write_text("the user's")
            users.append(run / name / "mine.txt")
        theirs = {path: data for path, data in snapshot(run).items() if Path(path) in users} | snapshot(outside)

        def open_latest() -> None:
            version = ws.latest(run)
            if version is not None:
                with ws.open(version) as store:
                    for key in store:
                        np.array(store[key])

        refused_or_read(run, open_latest)
        refused_or_read(run, lambda: next(ws.follow(run, timeout=0), None))
        for name in ("step-000000000002.npz", "step-000000000003.wsindex"):
            cli(run, "ls", "--json", str(run / name))
            cli(run, "verify", str(run / name))
        cli(run, "versions", "--json", str(run))
        cli(run, "clean", "--json", str(run))
        left = snapshot(run) | snapshot(outside)
        assert {path: left.get(path) for path in theirs} == theirs


@pytest.mark.parametrize("where", ["local", "memory"])
def test_pruning_and_cleaning_an_attempt_folder_leave_what_a_user_put_there(tmp_path, where):
    """A prune (``keep=``) and ``ws clean`` removed an attempt folder whole, a user's files and
    folders in it too, and a prune took any folder whose name began as one of its step's attempt
    folders (``….attempt-mine``, ``….attempt-0`` and a newline). Now only the files weightstore
    writes there go; the folder stays with the rest, reported as kept."""
    run = str(tmp_path / "run") if where == "local" else f"memory://{tmp_path.name}/run"
    options = {"one_writer": True} if where == "memory" else None
    import fsspec

    fs, root = fsspec.core.url_to_fs(run)
    for step in (1, 2):
        for attempt in (0, 1):
            ws.publish_shard(run, {"w": [ws.Piece(np.ones(2, np.float32), (0,), (2,))]}, step=step, rank=0, world=1,
                             attempt=attempt, storage_options=options)
    users = [f"{root}/step-000000000001.attempt-1/notes.txt", f"{root}/step-000000000001.attempt-1/data/kept.bin",
             f"{root}/step-000000000001.attempt-mine/notes.txt", f"{root}/step-000000000001.attempt-0\n/notes.txt",
             f"{root}/step-000000000002.attempt-1/notes.txt"]
    for user in users:
        fs.makedirs(user.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe(user, b"the user's")
    with pytest.warns(UserWarning, match=r"step-000000000001\.attempt-1: kept: it holds what weightstore does not "
                                         r"write there \(data, notes\.txt\)"):
        ws.commit_shards(run, step=1, world=1, attempt=0, timeout=10, storage_options=options)  # attempt 1: dead
    with pytest.warns(UserWarning, match=r"step-000000000001\.attempt-1: kept"):
        for step in (3, 4):
            ws.publish(run, {"w": np.ones(2, np.float32)}, step=step, keep=1, storage_options=options)  # step 1 pruned
    assert not fs.exists(f"{root}/step-000000000001.attempt-0")
    assert not fs.exists(f"{root}/step-000000000001.attempt-1/rank-00000.done")  # weightstore's own files go
    from weightstore.sharded._shards import clean_folder

    with pytest.warns(UserWarning, match=r"step-000000000002\.attempt-1: kept: .*\(notes\.txt\)"):
        removed = clean_folder(run, storage_options=options)
    assert "step-000000000002.attempt-0" in removed and "step-000000000002.attempt-1" not in removed
    assert [fs.cat(user) for user in users] == [b"the user's"] * len(users)


def test_clean_refuses_an_attempt_folder_it_cannot_list_by_name(tmp_path):
    """An attempt folder that is a symbolic link loop leaked a bare OSError (ELOOP) from ``ws clean``."""
    ws.publish_shard(tmp_path, {"w": [ws.Piece(np.ones(2, np.float32), (0,), (2,))]}, step=1, rank=0, world=1,
                     attempt=0)
    ws.commit_shards(tmp_path, step=1, world=1, attempt=0, timeout=10)
    attempt = tmp_path / "step-000000000001.attempt-0"
    shutil.rmtree(attempt)
    attempt.symlink_to(attempt.name)
    from weightstore.sharded._shards import clean_folder

    with pytest.raises(ws.FileAccessError, match="cannot be listed") as caught:
        clean_folder(tmp_path)
    assert caught.value.path == str(attempt)
    result = CliRunner().invoke(app, ["clean", str(tmp_path)])
    assert result.exit_code == 1 and f"{attempt}: cannot be listed (Too many levels of symbolic links)" in result.output
    assert attempt.is_symlink()
