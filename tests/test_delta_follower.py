"""A Follower of delta versions: each delta applied onto the copy of the version it holds, only
the new deltas fetched (counted on the loopback S3 server), the newest anchor read when the held
version is not in the chain or the chain fails, and never wrong weights."""

from __future__ import annotations

import inspect
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import weightstore as ws

torch = pytest.importorskip("torch")
from weightstore.adapters import torch as torch_adapter  # noqa: E402
from weightstore.adapters.serving.follower import Follower  # noqa: E402
from weightstore.io.folders import folder_for  # noqa: E402
from weightstore.sync import _stages as stages  # noqa: E402

BUCKET = "weightstore-delta-follower"


def module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 64))


def step_of(weights: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """2% of every tensor's elements move one ulp."""
    moved = {}
    for key, value in weights.items():
        bits = value.view(np.uint32).copy()
        where = rng.choice(bits.size, max(1, bits.size // 50), replace=False)
        bits.reshape(-1)[where] += 1
        moved[key] = bits.view(np.float32)
    return moved


def held_by(target: torch.nn.Module) -> dict[str, np.ndarray]:
    return {key: np.array(value) for key, value in torch_adapter.export(target).items()}


def same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key


def run(folder, target, steps, weights, rng, delta, follower, **publish):
    for step in steps:
        weights = step_of(weights, rng)
        ws.publish(folder, weights, step=step, delta=delta, **publish)
        assert follower.wait(step, timeout=60) is not None and follower.version.step == step
        same(held_by(target), weights)
    return weights


def test_a_follower_on_s3_fetches_only_the_new_delta(s3):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    target, rng, delta = module(), np.random.default_rng(0), ws.Delta(anchor_every=20)
    weights = {key: np.array(value) for key, value in torch_adapter.export(module()).items()}
    full = sum(value.nbytes for value in weights.values())
    with Follower(target, folder, poll=0.05, deltas=True) as follower:  # a copy from the first version on
        weights = run(folder, target, [1], weights, rng, delta, follower)
        for step in (2, 3, 4):
            s3.reset()
            weights = run(folder, target, [step], weights, rng, delta, follower)
            fetched = s3.bytes_sent()
            delta_file = next(e.size for e in ws.sync.list_versions(folder) if e.step == step)
            assert fetched < 0.15 * full, (fetched, full)
            assert fetched < 2 * delta_file + 64 * 1024, (fetched, delta_file)
        assert follower.error is None


def test_a_follower_that_missed_an_anchor_reads_the_newest_one(tmp_path):
    target, rng, delta = module(), np.random.default_rng(1), ws.Delta(anchor_every=3)
    weights = {key: np.array(value) for key, value in torch_adapter.export(module()).items()}
    with Follower(target, tmp_path, poll=0.05) as follower:
        weights = run(tmp_path, target, [1, 2], weights, rng, delta, follower)
        follower.stop()
        for step in (3, 4, 5):  # 4 is an anchor: step 2 is not in 5's chain
            weights = step_of(weights, rng)
            ws.publish(tmp_path, weights, step=step, delta=delta)
        follower.start()
        assert follower.wait(5, timeout=60) is not None
        same(held_by(target), weights)
        assert follower.error is None


def test_a_held_copy_that_does_not_rebuild_falls_back_to_the_anchor(tmp_path, caplog):
    target, rng, delta = module(), np.random.default_rng(2), ws.Delta()
    weights = {key: np.array(value) for key, value in torch_adapter.export(module()).items()}
    with Follower(target, tmp_path, poll=0.05) as follower:
        weights = run(tmp_path, target, [1, 2], weights, rng, delta, follower)
        for _, data in follower._held.values():  # what the chain is applied onto, damaged
            data[:8] ^= 0xFF
        weights = run(tmp_path, target, [3], weights, rng, delta, follower)
        assert "reading the rest from its anchor" in caplog.text
        weights = run(tmp_path, target, [4], weights, rng, delta, follower)  # the copies are whole again
        assert follower.error is None


def test_a_corrupt_delta_is_passed_over_and_the_weights_stay(tmp_path, monkeypatch):
    """The delta is damaged before ``LATEST`` names it: damaged after, a follower polling every
    0.05 s could take step 3 whole between the publish and the damage."""
    target, rng, delta = module(), np.random.default_rng(3), ws.Delta()
    weights = {key: np.array(value) for key, value in torch_adapter.export(module()).items()}
    path = tmp_path / "step-000000000003.wsdelta"

    def damage(stage: str) -> None:
        if stage == "version-written" and path.exists():
            data = bytearray(path.read_bytes())
            data[-3] ^= 0xFF
            path.write_bytes(bytes(data))

    with Follower(target, tmp_path, poll=0.05) as follower:
        weights = run(tmp_path, target, [1, 2], weights, rng, delta, follower)
        monkeypatch.setattr(stages, "hook", damage)
        version = ws.publish(tmp_path, step_of(weights, rng), step=3, delta=delta)
        monkeypatch.setattr(stages, "hook", None)
        assert Path(version.path) == path
        with pytest.raises(ws.WeightStoreError):
            follower.wait(3, timeout=30)
        same(held_by(target), weights)  # still step 2's, whole


def test_a_follower_into_tf_never_writes_memory_a_tensor_still_holds(tmp_path):
    """TF adopts each rebuilt tensor as its variable's buffer, and the follower reuses the buffer
    a variable let go of for its next copy: a tensor read from an older version keeps its bytes."""
    tf = pytest.importorskip("tensorflow")
    rng, delta = np.random.default_rng(4), ws.Delta()
    weights = {f"layer_{i}/kernel": rng.standard_normal((256, 128)).astype(np.float32) for i in range(3)}
    target = {key: tf.Variable(tf.zeros(value.shape)) for key, value in weights.items()}
    read: list[tuple[dict[str, object], dict[str, np.ndarray]]] = []
    with Follower(target, tmp_path, poll=0.02, deltas=True) as follower:
        for step in range(1, 7):
            weights = step_of(weights, rng)
            ws.publish(tmp_path, weights, step=step, delta=delta)
            assert follower.wait(step, timeout=60) is not None
            if step % 2:  # held on to: the memory of this version's variables stays in use
                read.append(({key: variable.read_value() for key, variable in target.items()}, weights))
            same({key: variable.numpy() for key, variable in target.items()}, weights)
        assert follower.error is None
    for tensors, want in read:
        same({key: tensor.numpy() for key, tensor in tensors.items()}, want)


def test_an_anchor_damaged_under_running_followers_is_named_to_one_that_restarts(tmp_path, caplog):
    """A follower holding a version is not hurt (it never reads the anchor again); one that
    restarts on a delta built on it cannot read it, and its log names the damaged anchor, the
    file to replace. The trainer's next publish sees its anchor changed and is written full,
    which both serve."""
    target, rng, delta = module(), np.random.default_rng(4), ws.Delta(anchor_every=4)
    weights = {key: np.array(value) for key, value in torch_adapter.export(module()).items()}
    with Follower(target, tmp_path, poll=0.05) as follower:
        weights = run(tmp_path, target, [1, 2], weights, rng, delta, follower)
        anchor = tmp_path / "step-000000000001.npz"
        data = bytearray(anchor.read_bytes())
        data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: the file still opens
        anchor.write_bytes(bytes(data))
        restarted = module()
        with Follower(restarted, tmp_path, poll=0.05) as fresh:
            with pytest.raises(ws.ChecksumError):
                fresh.wait(2, timeout=30)
            assert "in its chain, step-000000000001.npz: is corrupt" in str(fresh.error)
            assert "in its chain, step-000000000001.npz: is corrupt" in caplog.text
            weights = run(tmp_path, target, [3], weights, rng, delta, follower)
            assert Path(follower.version.path).suffix == ".npz"  # not a delta on the damaged anchor
            assert fresh.wait(3, timeout=30) is not None and fresh.error is None
            same(held_by(restarted), weights)


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("fmt", ["npz", "hdf5", "safetensors"])
@pytest.mark.filterwarnings("ignore::weightstore.formats.hdf5.RemoteHDF5Warning")
def test_a_state_dict_published_as_deltas_keeps_its_names_and_follows(tmp_path, request, where, fmt):
    """A version of ``state_dict()`` is a file like ``ws.save``'s, named as ``load_state_dict``
    takes it (``safetensors.torch.load_file`` and ``np.load`` of a version gave those names
    before versions were read by keys), and read by its keys: by a follower, and as the base of
    the delta versions after it, locally and on S3 (where an HDF5 anchor, given to h5py as
    ranged reads, was refused under every delta)."""
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}" if where == "s3" else str(tmp_path)
    if where == "s3":
        request.getfixturevalue("s3")
    target, rng, delta = module(), np.random.default_rng(4), ws.Delta(anchor_every=20)
    weights = {key: np.array(value) for key, value in torch_adapter.export(module()).items()}
    names = list(module().state_dict())
    with Follower(target, folder, poll=0.05, deltas=True) as follower:
        for step in (1, 2, 3):
            weights = step_of(weights, rng)
            state_dict = {name: torch.from_numpy(weights[key]) for name, key in zip(names, weights, strict=True)}
            ws.publish(folder, state_dict, step=step, delta=delta, format=fmt)
            assert follower.wait(step, timeout=60) is not None and follower.version.step == step
            same(held_by(target), weights)
        assert follower.error is None
    assert [entry.kind for entry in ws.sync.list_versions(folder)] == ["full", "delta", "delta"]
    with ws.open(ws.sync.list_versions(folder)[0].path) as anchor:
        assert [anchor.stored_names()[key] for key in anchor] == names
    same(ws.load(ws.sync.list_versions(folder)[-1].path), weights)  # rebuilt from its base, read by key


def _folder(tmp_path, request, where: str) -> str:
    if where == "s3":
        request.getfixturevalue("s3")
        return f"s3://{BUCKET}/{uuid.uuid4().hex}"
    return str(tmp_path)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_follower_catching_up_reads_only_the_deltas_after_the_version_it_holds(tmp_path, request, where):
    """A follower holding step 8 of a chain catches up to step 12 from the deltas 9-12 alone: with
    the anchor and every delta below step 8 gone it still serves step 12's weights. Its cost grows
    with the versions it missed, not with the chain's depth (a local one opened the whole chain,
    down to the anchor, to pin each version)."""
    folder = _folder(tmp_path, request, where)
    target, rng, delta = module(), np.random.default_rng(5), ws.Delta(anchor_every=50)
    weights = {key: np.array(value) for key, value in torch_adapter.export(module()).items()}
    with Follower(target, folder, poll=0.02, deltas=True) as follower:
        weights = run(folder, target, [1], weights, rng, delta, follower, keep=None)
        for step in range(2, 13):
            if step == 8:
                weights = run(folder, target, [8], weights, rng, delta, follower, keep=None)
                follower.stop()
                continue
            weights = step_of(weights, rng)
            ws.publish(folder, weights, step=step, delta=delta, keep=None)
        versions = ws.sync.list_versions(folder)
        assert [entry.kind for entry in versions] == ["full", *["delta"] * 11]
        source = folder_for(folder)
        for entry in versions[:8]:  # the anchor, the deltas below step 8, and step 8: its tensors are held
            source.remove(entry.name)
        follower.start()
        assert follower.wait(12, timeout=60) is not None and follower.version.step == 12
        same(held_by(target), weights)
        assert follower.error is None


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("route", ["chain", "anchor"])
def test_a_follower_that_loses_a_race_with_retention_never_serves_wrong_weights(tmp_path, request, caplog, where,
                                                                                  route):
    """Between the follower's look at step 6 (a delta on the step 3 it holds) and its read, the
    trainer publishes an anchor and a delta with ``keep=1``: retention removes steps 1-6. Locally
    step 6 is pinned down to step 3 (its deltas 4-6 stay mapped) and rests on the pin of step 3:
    rebuilt onto the held copy, or read from its anchor through that pin where the copy does not
    rebuild, it is served as published. On S3, which pins nothing, the version is gone: the
    follower reads ``LATEST`` again and serves step 8, with no failure."""
    folder = _folder(tmp_path, request, where)
    target, rng, delta = module(), np.random.default_rng(6), ws.Delta(anchor_every=50)
    weights = {key: np.array(value) for key, value in torch_adapter.export(module()).items()}
    published, served = {}, {}
    with Follower(target, folder, poll=0.02, deltas=True) as follower:
        weights = run(folder, target, [1, 2, 3], weights, rng, delta, follower, keep=None)
        follower.stop()
        for step in (4, 5, 6):
            weights = published[step] = step_of(weights, rng)
            ws.publish(folder, weights, step=step, delta=delta, keep=None)
        if route == "anchor":
            for _, data in follower._held.values():  # what the chain is applied onto, damaged
                data[:8] ^= 0xFF
        stage, assign = follower._stage, follower._assign

        def racing(version, skip, words):
            if version.step == 6 and 7 not in published:
                published[7] = step_of(published[6], rng)
                ws.publish(folder, published[7], step=7, keep=None)  # an anchor
                published[8] = step_of(published[7], rng)
                ws.publish(folder, published[8], step=8, delta=ws.Delta(), keep=1)
                assert [entry.step for entry in ws.sync.list_versions(folder)] == [7, 8]
            return stage(version, skip, words)

        def recorded(target, staged, **words):
            report = assign(target, staged, **words)
            served[int(Path(staged.path).name[5:17])] = held_by(target)
            return report

        follower._stage, follower._assign = racing, recorded
        follower.start()
        assert follower.wait(8, timeout=60) is not None
        assert follower.error is None and "assigning step" not in caplog.text
    for step, held in served.items():
        same(held, published[step])
    assert 8 in served and (6 in served) == (where == "local")


def test_a_stopped_followers_version_stays_readable_however_much_is_pruned(tmp_path):
    """Its pin of step 3 opened only the delta since step 2, the version it held; the rest of
    the chain is read through the pins of the versions before. Pruned down to nothing, step 3
    still reads whole, as the Follower promises of its current version (``ws.load`` of a
    version pinned down to step 2 alone said it was gone)."""
    target, rng, delta = module(), np.random.default_rng(7), ws.Delta(anchor_every=50)
    weights = {key: np.array(value) for key, value in torch_adapter.export(module()).items()}
    with Follower(target, tmp_path, poll=0.02, deltas=True) as follower:
        weights = run(tmp_path, target, [1, 2, 3], weights, rng, delta, follower, keep=None)
        follower.stop()
        later = step_of(weights, rng)
        ws.publish(tmp_path, later, step=4, keep=None)  # an anchor
        ws.publish(tmp_path, step_of(later, rng), step=5, delta=ws.Delta(), keep=1)
        assert [entry.step for entry in ws.sync.list_versions(tmp_path)] == [4, 5]
        assert follower.version.step == 3
        same(ws.load(follower.version), weights)


def test_versions_each_resting_on_the_one_before_read_and_close_in_a_stack_of_their_own(tmp_path):
    """Each version pinned down to the one before rests on its pin, and that one on the one
    before it: reading the newest whole, and letting the line go, walk the chain in a loop, not
    a call inside another per version (which passed Python's 1,000 frames at 300 versions)."""
    weights, held = np.zeros(1024, np.float32), None
    for step in range(1, 41):
        weights = weights.copy()
        weights[step] += 1
        ws.publish(tmp_path, {"w": weights}, step=step, delta=ws.Delta(anchor_every=100), keep=None)
        version = ws.sync.latest(tmp_path)
        version.pin(held)
        if held is not None:
            held.release()
        held = version
    assert [entry.kind for entry in ws.sync.list_versions(tmp_path)] == ["full", *["delta"] * 39]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + 100)  # 40 versions within each other pass it
    try:
        assert ws.load(held)["w"].tobytes() == weights.tobytes()
        held.release()
    finally:
        sys.setrecursionlimit(limit)
