"""Delta versions: written when smaller, read as a version like any other, kept with their bases,
and every hostile or broken chain refused with the version and the tensor named."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import zstandard
from typer.testing import CliRunner

import weightstore as ws
from weightstore.cli.main import app
from weightstore.core.manifest import content_digest, crc32
from weightstore.formats import delta as delta_format

BUCKET = "weightstore-delta-tests"


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense/kernel": rng.standard_normal((256, 300)).astype(ml_dtypes.bfloat16),
        "dense/bias": rng.standard_normal(300).astype(np.float32),
        "embed": rng.standard_normal((100, 64)).astype(np.float32),
        "count": np.array(7, np.int64),
        "mask": rng.random(40) < 0.5,
        "empty": np.zeros((0, 3), np.float16),
        "wide": rng.standard_normal(8).astype(np.complex128),
    }


def step_of(weights: dict[str, np.ndarray], rng: np.random.Generator, fraction: float = 0.02) -> dict[str, np.ndarray]:
    """The next optimizer step: ``fraction`` of the bf16 kernel's elements move one ulp, the
    bias moves a little everywhere, the rest stays."""
    kernel = weights["dense/kernel"].view(np.uint16).copy()
    where = rng.choice(kernel.size, max(1, int(kernel.size * fraction)), replace=False)
    kernel.reshape(-1)[where] += 1
    bias = (weights["dense/bias"] * np.float32(1.001)).astype(np.float32)
    return {**weights, "dense/kernel": kernel.view(ml_dtypes.bfloat16), "dense/bias": bias}


def same_bytes(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert np.ascontiguousarray(got[key]).tobytes() == np.ascontiguousarray(value).tobytes(), key


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))


def publish_steps(folder, steps: int, *, delta, keep=None, seed=0):
    rng = np.random.default_rng(seed)
    weights, published = model(seed), {}
    for step in range(1, steps + 1):
        weights = step_of(weights, rng)
        ws.publish(folder, weights, step=step, keep=keep, delta=delta)
        published[step] = {k: np.array(v) for k, v in weights.items()}
    return published


def test_every_version_reads_bit_exact_and_deltas_are_small(tmp_path):
    delta = ws.Delta(anchor_every=4)
    published = publish_steps(tmp_path, 9, delta=delta)
    names = files(tmp_path)
    assert [n.rsplit(".", 1)[1] for n in names] == ["npz", "wsdelta", "wsdelta", "wsdelta"] * 2 + ["npz"]
    full = (tmp_path / names[0]).stat().st_size
    for name in names:
        if name.endswith(".wsdelta"):
            assert (tmp_path / name).stat().st_size < 0.1 * full
    for step, name in zip(range(1, 10), names, strict=True):
        same_bytes(ws.load(tmp_path / name), published[step])
    latest = ws.latest(tmp_path)
    same_bytes(ws.load(latest), published[9])
    with ws.open(tmp_path / names[3]) as store:  # a delta three from its anchor
        info = store.info("dense/kernel")
        assert info.digest == "blake3:" + content_digest(published[4]["dense/kernel"].view(np.uint8)).hex()
        assert store.metadata == {}


def test_a_step_that_moves_every_element_is_still_exact(tmp_path):
    rng = np.random.default_rng(1)
    weights = {"w": rng.standard_normal(20000).astype(np.float32)}
    delta = ws.Delta()
    ws.publish(tmp_path, weights, step=1, delta=delta)
    moved = {"w": (weights["w"] * np.float32(1 + 1e-3)).astype(np.float32)}
    version = ws.publish(tmp_path, moved, step=2, delta=delta)
    assert version.path.endswith(".wsdelta")  # XOR of close floats: the high bytes cancel
    assert Path(version.path).stat().st_size < 0.9 * moved["w"].nbytes
    same_bytes(ws.load(version), moved)
    replaced = {"w": rng.standard_normal(20000).astype(np.float32)}  # no delta is smaller: a full one
    version = ws.publish(tmp_path, replaced, step=3, delta=delta)
    assert version.path.endswith(".npz") and delta.last_kind == "full"
    same_bytes(ws.load(version), replaced)


def test_codecs_each_rebuild_their_tensor():
    rng = np.random.default_rng(2)
    base = rng.standard_normal(300000).astype(np.float32)
    cases = {"same": base.copy(), "sparse": base.copy(), "xor-zstd": base.copy(), "raw": rng.integers(0, 2**32, 300000, dtype=np.uint32).view(np.float32)}
    cases["sparse"][[0, 5, 70000, 299999]] = 1.0
    cases["xor-zstd"][:] = (cases["xor-zstd"] * np.float32(1.001)).astype(np.float32)  # every element: dense
    for codec, new in cases.items():
        raw = new.view(np.uint8)
        encoded = delta_format.encode(raw, base.view(np.uint8), 4)
        assert encoded.codec == codec
        out = base.view(np.uint8).copy()
        payload = memoryview(b"".join(bytes(memoryview(part)) for part in encoded.parts))
        if codec == "xor-zstd":
            delta_format._apply_xor(payload, out, delta_format.BLOCK, 4)
        elif codec == "sparse":
            delta_format._apply_sparse(payload, out, 4)
        elif codec == "raw":
            out[:] = np.frombuffer(payload, np.uint8)
        assert out.tobytes() == raw.tobytes(), codec


def test_anchor_once_the_chain_adds_up_to_a_full_version(tmp_path):
    rng = np.random.default_rng(3)
    weights = {"w": rng.standard_normal(10000).astype(np.float32)}
    delta = ws.Delta(anchor_every=100)
    kinds = []
    for step in range(1, 8):
        weights = {"w": (weights["w"] * np.float32(1.01)).astype(np.float32)}  # each delta ~half a version
        ws.publish(tmp_path, weights, step=step, delta=delta)
        kinds.append(delta.last_kind)
    assert kinds[0] == "full" and "delta" in kinds
    chain = 0
    for name in files(tmp_path):
        if name.endswith(".wsdelta"):
            head = delta_format.read_head(str(tmp_path / name), name)
            assert head.chain_bytes < head.full_bytes
            chain += 1
    assert kinds.count("full") >= 2


def test_a_restarted_trainer_reads_its_base_back(tmp_path):
    rng = np.random.default_rng(4)
    weights = model(4)
    ws.publish(tmp_path, weights, step=1, delta=ws.Delta())
    for step in (2, 3):
        weights = step_of(weights, rng)
        version = ws.publish(tmp_path, weights, step=step, delta=True)  # no memory: the base read back
        assert version.path.endswith(".wsdelta")
        same_bytes(ws.load(version), weights)


def test_the_remembered_copy_is_not_the_callers_array(tmp_path):
    weights = model(5)
    delta = ws.Delta()
    ws.publish(tmp_path, weights, step=1, delta=delta)
    weights["embed"][0, 0] += 1  # changed in place after the publish returned
    version = ws.publish(tmp_path, weights, step=2, delta=delta)
    same_bytes(ws.load(version), weights)


def test_an_fp32_publisher_copies_no_delta_an_anchor_follows_and_rebuilds_every_version(tmp_path):
    """fp32 Adam-like steps (every element moves; a delta 0.6x a version) alternate delta and
    anchor: the delta's bytes are not copied to remember (the anchor reads no base); every
    version reads back as published, and a model grown past the anchor's prediction after such
    a delta is written full (its base's bytes are not held)."""
    rng = np.random.default_rng(3)
    weights = {"w": rng.standard_normal((256, 1024)).astype(np.float32), "b": np.zeros(1024, np.float32)}
    folder, planner, kinds = tmp_path / "run", ws.Delta(anchor_every=20), []
    for step in range(1, 7):
        weights = {key: value + np.float32(1e-3) * rng.standard_normal(value.shape).astype(np.float32)
                   for key, value in weights.items()}
        if step == 5:  # grown to where no anchor is predicted, after a delta whose bytes were not kept
            weights["extra"] = rng.standard_normal((512, 1024)).astype(np.float32)
            assert not planner._anchor_due(planner._held.head.chain_bytes, sum(v.nbytes for v in weights.values()))
        version = ws.publish(folder, weights, step=step, delta=planner)
        kinds.append(planner.last_kind)
        held = planner._held
        assert held is not None and held.current == (planner.last_kind == "full"), step
        same_bytes(ws.load(version), weights)
    assert kinds == ["full", "delta", "full", "delta", "full", "delta"]


def test_retention_keeps_every_base_a_kept_version_needs(tmp_path):
    published = publish_steps(tmp_path, 7, delta=ws.Delta(anchor_every=10), keep=2)
    assert files(tmp_path) == [f"step-{s:012d}.{'npz' if s == 1 else 'wsdelta'}" for s in range(1, 8)]
    same_bytes(ws.load(ws.latest(tmp_path)), published[7])
    published = publish_steps(tmp_path / "b", 12, delta=ws.Delta(anchor_every=5), keep=2)
    # anchors at 1, 6, 11: the chain of 11..12 needs nothing older
    assert files(tmp_path / "b") == ["step-000000000011.npz", "step-000000000012.wsdelta"]
    same_bytes(ws.load(ws.latest(tmp_path / "b")), published[12])


def test_a_delta_publisher_prunes_by_the_chain_it_holds_reading_no_head(tmp_path, monkeypatch):
    """The oldest version retention keeps is in the chain of the delta just published, which
    its publisher holds: what it needs is the rest of that chain, not read from its head, and
    the versions past its anchor still go."""
    publish_steps(tmp_path, 6, delta=ws.Delta(anchor_every=4), keep=2)  # anchors at 1 and 5
    assert files(tmp_path) == ["step-000000000005.npz", "step-000000000006.wsdelta"]
    read: list[str] = []
    real = delta_format.read_head
    monkeypatch.setattr(delta_format, "read_head", lambda *args, **kwargs: read.append(args[1]) or real(*args, **kwargs))
    delta = ws.Delta(anchor_every=4)
    published = publish_steps(tmp_path / "b", 4, delta=delta, keep=2)
    assert read == [] and delta.last_kind == "delta"
    assert files(tmp_path / "b") == [f"step-{s:012d}.{'npz' if s == 1 else 'wsdelta'}" for s in range(1, 5)]
    same_bytes(ws.load(ws.latest(tmp_path / "b")), published[4])


def test_follow_yields_delta_versions_whole(tmp_path):
    published = publish_steps(tmp_path, 3, delta=ws.Delta())
    for version in ws.follow(tmp_path, timeout=0):
        assert version.step == 3 and version.path.endswith(".wsdelta")
        same_bytes(ws.load(version), published[3])
        break


def test_background_publisher_writes_deltas(tmp_path):
    rng = np.random.default_rng(6)
    weights = model(6)
    with ws.BackgroundPublisher(tmp_path, delta=True) as publisher:
        for step in range(1, 5):
            weights = step_of(weights, rng)
            publisher.publish(weights, step=step).result()
    assert publisher.failures == 0
    assert sum(name.endswith(".wsdelta") for name in files(tmp_path)) == 3
    same_bytes(ws.load(ws.latest(tmp_path)), weights)


def test_cli_reads_and_lists_delta_versions(tmp_path):
    published = publish_steps(tmp_path / "run", 3, delta=ws.Delta())
    runner = CliRunner()
    name = tmp_path / "run" / "step-000000000003.wsdelta"
    result = runner.invoke(app, ["verify", str(name)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["export", str(name), "-o", str(tmp_path / "out.h5")])
    assert result.exit_code == 0, result.output
    same_bytes(ws.load(tmp_path / "out.h5"), published[3])
    result = runner.invoke(app, ["versions", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)["versions"]
    assert [(v["kind"], v["base"]) for v in listed] == [
        ("full", None), ("delta", "step-000000000001.npz"), ("delta", "step-000000000002.wsdelta")]
    result = CliRunner().invoke(app, ["versions", str(tmp_path / "run")], env={"COLUMNS": "200"})
    assert "delta" in result.output and "(base step-000000000002.wsdelta)" in result.output


def test_ws_versions_marks_a_delta_whose_base_is_gone(tmp_path):
    """A base removed by hand makes its deltas unreadable; ``ws versions``, where one looks
    first, says so on the delta's line, not only a reader failing on it."""
    publish_steps(tmp_path / "run", 3, delta=ws.Delta())
    (tmp_path / "run" / "step-000000000001.npz").unlink()
    result = CliRunner().invoke(app, ["versions", str(tmp_path / "run")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "(base step-000000000001.npz, missing)" in result.output
    assert "(base step-000000000002.wsdelta)  <- LATEST" in result.output
    result = CliRunner().invoke(app, ["versions", str(tmp_path / "run"), "--json"])
    listed = json.loads(result.output)["versions"]
    assert [(v["step"], v["base_missing"]) for v in listed] == [(2, True), (3, False)]


def test_a_listing_takes_a_heads_chain_as_checked_only_where_it_is_of_its_files_step(tmp_path):
    """A listing checks each head's chain once, taking the chain the delta listed before it
    lists as checked: only where that head is of its own file's step. Here the file of step 3
    says step 10 (its chain checked below 10, its base step 5), and the head of step 4 lists
    steps 3 then 5, which is no chain: neither is listed as a delta of a base, as readers
    refuse both (step 3 was listed as step 5's delta)."""
    source, folder = tmp_path / "source", tmp_path / "run"
    ws.publish(source, {"w": np.arange(4000.0)}, step=1, delta=True)
    ws.publish(source, {"w": np.r_[np.arange(3999.0), 7.0]}, step=2, delta=True)
    folder.mkdir()
    ws.save(folder / "step-000000000005.npz", {"w": np.arange(4000.0)})
    heads = {"step-000000000003.wsdelta": (10, ["step-000000000005.npz"]),
             "step-000000000004.wsdelta": (4, ["step-000000000003.wsdelta", "step-000000000005.npz"])}
    for name, (step, chain) in heads.items():
        (folder / name).write_bytes((source / "step-000000000002.wsdelta").read_bytes())
        _edit_head(folder / name, lambda head, step=step, chain=chain: head.update(step=step, base=chain[0], chain=chain))
    assert [(entry.step, entry.base) for entry in ws.sync.list_versions(folder)] == [
        (3, None), (4, None), (5, None)]
    for name in heads:
        with pytest.raises(ws.FormatError):
            ws.load(folder / name)


def test_a_delta_on_s3_reads_and_follows(s3):
    folder = f"s3://{BUCKET}/run"
    published = publish_steps(folder, 4, delta=ws.Delta(), keep=2)
    version = ws.latest(folder)
    assert version.path.endswith(".wsdelta")
    same_bytes(ws.load(version), published[4])
    listed = ws.sync.list_versions(folder)
    assert [entry.kind for entry in listed] == ["full", "delta", "delta", "delta"]


def test_a_base_missing_in_a_chain_on_s3_is_named_from_the_version_read(s3):
    """A remote chain's bases are opened when first read, the prefetch of ``ws.load`` first: a
    base missing there was named from the delta above it, not the version read (``ws.load`` of
    step 6 said step 4 needs its base step 3), as a rebuild names it, and no file is left open."""
    import s3fs

    folder = f"s3://{BUCKET}/missing-base"
    publish_steps(folder, 6, delta=ws.Delta())
    assert [entry.kind for entry in ws.sync.list_versions(folder)] == ["full"] + ["delta"] * 5
    s3fs.S3FileSystem().rm_file(f"{folder}/step-000000000003.wsdelta")
    with pytest.raises(ws.FormatError) as caught:
        ws.load(f"{folder}/step-000000000006.wsdelta")
    assert caught.value.path == f"{folder}/step-000000000006.wsdelta"
    assert caught.value.message == ("in its chain, step-000000000004.wsdelta: needs its base step-000000000003.wsdelta, "
                                    "which is missing (pruned by hand, or never copied with it)")


def test_ws_verify_says_a_base_missing_on_s3_once_for_every_tensor_it_fails(s3):
    """A remote chain's bases are opened as its tensors are read, so a missing one fails every
    tensor alike: ``ws verify`` (of the folder, and of the version) said that fault again for each
    tensor, in a line as long as the model's keys; it says it once, with the tensors it fails."""
    import s3fs
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    folder = f"s3://{BUCKET}/missing-base-verify"
    publish_steps(folder, 3, delta=ws.Delta())
    s3fs.S3FileSystem().rm_file(f"{folder}/step-000000000002.wsdelta")
    for target in (folder, f"{folder}/step-000000000003.wsdelta"):
        result = CliRunner().invoke(app, ["verify", target])
        assert result.exit_code == 1, result.output
        said = " ".join(result.output.split())
        assert said.count("needs its base step-000000000002.wsdelta, which is missing") == 1, said
        assert "tensors 'dense/kernel', 'dense/bias', 'embed' and 3 more: needs its base" in said, said


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_delta_encoded_before_another_publisher_committed_is_written_whole_not_based_off_the_line(
        where, request, tmp_path, monkeypatch, caplog):
    """Two trainers on one folder (against the rule, or a forked child of a trainer): a delta is
    encoded before the folder is locked, so another trainer may commit in between. Committed, it
    would be based off the line LATEST went down, and retention then pruned a base it needed (two
    local trainers left every kept version unreadable). Its weights are written whole instead,
    said in the log, and every kept version reads; in a local folder as on object storage."""
    folder = str(tmp_path / "two-trainers") if where == "local" else (
        request.getfixturevalue("s3") and f"s3://{BUCKET}/two-trainers")
    rng = np.random.default_rng(0)
    mine, theirs = model(), model(1)
    ws.publish(folder, mine, step=1, keep=2, delta=(trainer := ws.Delta()))
    mine = step_of(mine, rng)
    ws.publish(folder, mine, step=2, keep=2, delta=trainer)

    encode = type(trainer).plan

    def other_trainer_commits_after_the_encode(self, target, step, tensors):  # before this one locks the folder
        monkeypatch.setattr(type(trainer), "plan", encode)
        planned = encode(self, target, step, tensors)
        ws.publish(folder, theirs, step=3, keep=2)
        return planned

    monkeypatch.setattr(type(trainer), "plan", other_trainer_commits_after_the_encode)
    mine = step_of(mine, rng)
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        version = ws.publish(folder, mine, step=4, keep=2, delta=trainer)
    assert version.path.endswith("step-000000000004.npz") and ws.latest(folder).step == 4
    assert any("LATEST moved to step 3 while step 4 was encoded as a delta of step-000000000002.wsdelta"
               in record.getMessage() for record in caplog.records)
    assert [entry.step for entry in ws.sync.list_versions(folder)] == [3, 4]
    same_bytes(ws.load(ws.sync.list_versions(folder)[0].path), theirs)
    same_bytes(ws.load(ws.latest(folder)), mine)
    mine = step_of(mine, rng)
    assert ws.publish(folder, mine, step=5, keep=2, delta=trainer).path.endswith(".wsdelta")  # onto step 4
    same_bytes(ws.load(ws.latest(folder)), mine)


# -- hostile and broken input ------------------------------------------------------------------------

def write_delta(path: Path, base: str, tensors: dict[str, tuple[str, list[bytes], np.ndarray]], *, step=None,
                chain=None, block=delta_format.BLOCK) -> None:
    """A delta file of our own making: ``tensors`` maps key -> (codec, payload parts, resulting array)."""
    rows, digests, encoded = [], [], []
    for key, (codec, parts, result) in tensors.items():
        raw = np.ascontiguousarray(result).reshape(-1).view(np.uint8)
        rows.append((key, ws.core.manifest.dtype_name(result.dtype), result.shape, crc32(raw)))
        digests.append(content_digest(raw))
        encoded.append(delta_format.Encoded(codec, parts))
    own = int(path.name[5:17]) if step is None else step
    head = delta_format.Head(own, base, chain or [base], 1, 10**9, block)
    buffer = io.BytesIO()
    delta_format.write(buffer, head, rows, digests, encoded, {}, "test", "2026-01-01T00:00:00.000Z")
    path.write_bytes(buffer.getvalue())


@pytest.fixture
def based(tmp_path):
    base = {"w": np.arange(1000, dtype=np.float32)}
    ws.save(tmp_path / "step-000000000001.npz", base)
    return tmp_path, base["w"]


def refused(path: Path, key: str | None = "w", error=ws.FormatError) -> ws.WeightStoreError:
    with pytest.raises(error) as caught:
        ws.load(path)
    assert caught.value.path is not None and path.name in str(caught.value.path)
    if key is not None:
        assert caught.value.key == key
    return caught.value


def test_a_frame_claiming_more_than_its_tensor_is_refused(based):
    folder, w = based
    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(w.nbytes * 1000))
    table = struct.pack("<II", 1, len(frame))
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000001.npz", {"w": ("xor-zstd", [table, frame], w)})
    assert "declare" in str(refused(folder / "step-000000000002.wsdelta"))


def test_a_frame_lying_about_its_size_is_refused(based):
    folder, w = based
    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(w.nbytes * 50))
    table = struct.pack("<II", 1, len(frame))
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000001.npz", {"w": ("xor-zstd", [table, frame], w)})
    refused(folder / "step-000000000002.wsdelta")


def sparse_parts(gaps, *, count=None, values=None, declared=True) -> list[bytes]:
    """A sparse payload of our own making: ``gaps`` as the positions' gaps, zero XORs as values."""
    import zstandard

    compressor = zstandard.ZstdCompressor(write_content_size=declared)
    gaps = np.asarray(gaps, "<u4")
    gap_frame = compressor.compress(delta_format._planes(gaps, 4))
    value_frame = compressor.compress(bytes(4 * len(gaps)) if values is None else values)
    return [struct.pack("<QQQ", len(gaps) if count is None else count, len(gap_frame), len(value_frame)), gap_frame,
            value_frame]


@pytest.mark.parametrize("gaps", [[4, 997], [6, 0], [1001], [2**32 - 1, 5], [2**31, 2**31, 2**31]])
def test_sparse_positions_out_of_range_or_not_increasing_are_refused(based, gaps):
    folder, w = based
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000001.npz", {"w": ("sparse", sparse_parts(gaps), w)})
    refused(folder / "step-000000000002.wsdelta")


@pytest.mark.parametrize("parts", [
    lambda: sparse_parts([1, 1], count=2**40),  # a count past the tensor
    lambda: sparse_parts([1, 1], count=3),  # frames that hold fewer items than the count
    lambda: sparse_parts([1, 1], values=bytes(8 * 1000)),  # a value frame larger than the count says
    lambda: sparse_parts([1, 1], declared=False),  # frames that do not declare their size
    lambda: sparse_parts([1, 1])[:1] + [b"junk"],  # lengths that do not add up
])
def test_a_sparse_entry_that_lies_about_its_sizes_is_refused(based, parts):
    folder, w = based
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000001.npz", {"w": ("sparse", parts(), w)})
    refused(folder / "step-000000000002.wsdelta")


@pytest.mark.parametrize("base", ["step-000000000002.wsdelta", "step-000000000003.wsdelta", "../x/step-000000000001.npz",
                                  "LATEST", "step-000000000001.wsindex"])
def test_a_base_that_is_not_an_earlier_version_beside_it_is_refused(based, base):
    folder, w = based
    write_delta(folder / "step-000000000002.wsdelta", base, {"w": ("same", [], w)})
    refused(folder / "step-000000000002.wsdelta", key=None)


def test_a_cycle_of_bases_is_refused(based):
    folder, w = based
    # each names the other; one of them must claim a step above its own name's, which is refused
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000003.wsdelta", {"w": ("same", [], w)}, step=4)
    write_delta(folder / "step-000000000003.wsdelta", "step-000000000002.wsdelta", {"w": ("same", [], w)})
    refused(folder / "step-000000000003.wsdelta", key=None)
    refused(folder / "step-000000000002.wsdelta", key=None)


def test_a_missing_base_is_refused_naming_it(based):
    folder, w = based
    write_delta(folder / "step-000000000005.wsdelta", "step-000000000004.npz", {"w": ("same", [], w)})
    error = refused(folder / "step-000000000005.wsdelta", key=None)
    assert "step-000000000004.npz" in str(error) and "missing" in str(error)


def test_a_chain_that_does_not_rebuild_the_digest_is_refused(based):
    folder, w = based
    wrong = w.copy()
    wrong[10] = -1  # the digest of what the delta claims to give, but the base gives the rest
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000001.npz", {"w": ("same", [], wrong)})
    error = refused(folder / "step-000000000002.wsdelta", error=ws.ChecksumError)
    assert "digest" in str(error) and "this delta is corrupt, or its base step-000000000001.npz is another" in str(error)


def test_an_anchor_replaced_by_another_whole_file_is_named_beside_the_delta_built_on_it(tmp_path):
    """A delta records its base's name, not its bytes: an anchor restored from another copy reads
    whole, so the first delta's refusal names both files rather than calling that delta corrupt."""
    publish_steps(tmp_path, 3, delta=ws.Delta())
    anchor = tmp_path / "step-000000000001.npz"
    ws.save(anchor, {key: np.zeros_like(value) for key, value in ws.load(anchor).items()})
    error = refused(tmp_path / "step-000000000003.wsdelta", key=None, error=ws.ChecksumError)
    assert ("step-000000000002.wsdelta is corrupt, or its base step-000000000001.npz is another whole file than the "
            "one it was built on") in error.message


def test_a_trainer_whose_anchor_is_damaged_writes_a_full_version_next_naming_it(tmp_path, caplog):
    """A publisher that remembers its base never reads the anchor again; damaged under it, the
    deltas it goes on writing are refused by every reader until its next anchor. Its next
    publish sees the chain's file changed, reads the base back, and writes that step full, with
    one log line naming the anchor; a file touched but unchanged keeps the deltas coming."""
    delta, rng = ws.Delta(anchor_every=10), np.random.default_rng(0)
    weights = model()
    for step in (1, 2):
        weights = step_of(weights, rng)
        ws.publish(tmp_path, weights, step=step, delta=delta)
    os.utime(tmp_path / "step-000000000001.npz")  # touched, its bytes intact: read back, and it passes
    weights = step_of(weights, rng)
    ws.publish(tmp_path, weights, step=3, delta=delta)
    anchor = tmp_path / "step-000000000001.npz"
    data = bytearray(anchor.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: the file still opens
    anchor.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        for step in (4, 5, 6):
            weights = step_of(weights, rng)
            ws.publish(tmp_path, weights, step=step, delta=delta)
    assert files(tmp_path) == ["step-000000000001.npz", "step-000000000002.wsdelta", "step-000000000003.wsdelta",
                               "step-000000000004.npz", "step-000000000005.wsdelta", "step-000000000006.wsdelta"]
    said = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(said) == 1 and "publishing step 4" in said[0] and "writing a full version" in said[0]
    assert "in its chain, step-000000000001.npz: is corrupt" in said[0]
    same_bytes(ws.load(ws.latest(tmp_path)), weights)


@pytest.mark.parametrize("keep", [5, None])
@pytest.mark.parametrize("anchor_is", ["replaced", "damaged", "removed"])
def test_a_trainer_on_s3_whose_anchor_changed_writes_a_full_version_next_at_no_request_more(s3, anchor_is, keep,
                                                                                           caplog):
    """On S3 a publisher looks at no file of its chain, but it lists the folder every publish:
    the listing's ETag, size and time of each file of the chain, compared with the listing
    after that file was published, tell an anchor replaced (with another whole file), damaged
    or removed under it. The next step is written full, with one warning naming the anchor,
    rather than deltas no follower rebuilds; and a delta publish makes as many requests
    however long its chain. With ``keep=None`` nothing lists the folder after a version's
    upload: the next publish's listing is the first look at it, and is what a change is told by."""
    import s3fs

    folder = f"s3://{BUCKET}/anchor-{anchor_is}-{keep}"
    delta, rng, weights = ws.Delta(anchor_every=20), np.random.default_rng(0), model()
    requests = []
    for step in range(1, 6):
        weights = step_of(weights, rng)
        s3.reset()
        ws.publish(folder, weights, step=step, delta=delta, keep=keep)
        requests.append((s3.count(), s3.count("HEAD"), s3.count("GET")))
    assert delta.last_kind == "delta"
    assert requests[2] == requests[3] == requests[4], requests  # chains of 2, 3 and 4 files
    anchor = f"{folder}/step-000000000001.npz"
    fs = s3fs.S3FileSystem()
    if anchor_is == "removed":
        fs.rm_file(anchor)
    elif anchor_is == "replaced":  # another whole file: it reads, but is not what the deltas build on
        ws.save(anchor, {key: np.zeros_like(value) for key, value in weights.items()}, overwrite=True)
    else:
        data = bytearray(fs.cat_file(anchor))
        data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: the file still opens
        fs.pipe_file(anchor, bytes(data))
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        for step in (6, 7):
            weights = step_of(weights, rng)
            ws.publish(folder, weights, step=step, delta=delta, keep=keep)
    kinds = [(entry.step, entry.kind) for entry in ws.sync.list_versions(folder)]
    assert kinds[-2:] == [(6, "full"), (7, "delta")], kinds
    said = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(said) == 1 and "step-000000000001.npz, which step 6 was encoded as a delta on" in said[0], said
    assert "written as a full version" in said[0]
    same_bytes(ws.load(ws.latest(folder)), weights)


@pytest.mark.parametrize("case", ["keep=None", "restarted"])
def test_a_trainer_on_s3_notices_a_replaced_anchor_without_retention_or_after_reading_its_base_back(s3, case, caplog):
    """Each file of the chain is compared with the listing as it was once published: a publisher
    with no retention (``keep=None``: no listing after its upload) and one restarted (its first
    delta reads its base back) still notice an anchor replaced under them, and write the next
    step full, rather than deltas on the replaced file that no reader rebuilds."""
    folder = f"s3://{BUCKET}/unseen-{case}"
    keep = None if case == "keep=None" else 5
    delta, rng, weights = ws.Delta(anchor_every=20), np.random.default_rng(0), model()
    for step in (1, 2, 3):
        if case == "restarted" and step == 3:
            delta = ws.Delta(anchor_every=20)
        weights = step_of(weights, rng)
        ws.publish(folder, weights, step=step, delta=delta, keep=keep)
    assert delta.last_kind == "delta"
    ws.save(f"{folder}/step-000000000001.npz", {key: np.zeros_like(value) for key, value in weights.items()},
            overwrite=True)
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        for step in (4, 5):
            weights = step_of(weights, rng)
            ws.publish(folder, weights, step=step, delta=delta, keep=keep)
    kinds = [(entry.step, entry.kind) for entry in ws.sync.list_versions(folder)]
    assert kinds[-2:] == [(4, "full"), (5, "delta")], kinds
    assert "step-000000000001.npz, which step 4 was encoded as a delta on" in caplog.text
    same_bytes(ws.load(ws.latest(folder)), weights)


def test_a_follower_on_s3_never_serves_a_delta_whose_anchor_was_replaced_after_it_was_built(s3):
    """A delta names its base, not its bytes; the digests it records of what it rebuilds are
    checked by every read: an anchor replaced on S3 by another whole file (a copy restored
    from elsewhere) after its deltas were written makes each of them refused when read, through
    ``ws.latest`` as through ``ws.follow`` (whose version opens: its chain is read with its
    tensors), never read as weights; the next version that reads is followed."""
    folder = f"s3://{BUCKET}/replaced-under-followers"
    published = publish_steps(folder, 3, delta=ws.Delta())
    anchor = f"{folder}/step-000000000001.npz"
    ws.save(anchor, {key: np.zeros_like(value) for key, value in published[1].items()}, overwrite=True)
    with pytest.raises(ws.ChecksumError, match="is another whole file than the one it was built on"):
        ws.load(ws.latest(folder))
    following = ws.follow(folder, poll=0.05, timeout=30)
    version = next(following)
    assert version.step == 3
    with ws.open(version) as store:
        for key, value in published[3].items():
            if value.size:  # an empty tensor is the same in any file
                with pytest.raises(ws.ChecksumError, match="is another whole file than the one it was built on"):
                    store[key]
    ws.publish(folder, published[3], step=4)
    version = next(following)
    assert version.step == 4
    same_bytes(ws.load(version), published[3])
    following.close()


def test_a_trainer_whose_anchor_is_removed_writes_a_full_version_next(tmp_path):
    """An anchor removed by hand leaves its deltas unreadable: the next delta is not built on them."""
    delta, rng = ws.Delta(), np.random.default_rng(0)
    weights = model()
    for step in (1, 2, 3):
        weights = step_of(weights, rng)
        ws.publish(tmp_path, weights, step=step, delta=delta)
        if step == 2:
            (tmp_path / "step-000000000001.npz").unlink()
    assert files(tmp_path)[-1] == "step-000000000003.npz"
    same_bytes(ws.load(ws.latest(tmp_path)), weights)


def test_a_corrupt_base_in_the_chain_is_refused(tmp_path):
    published = publish_steps(tmp_path, 3, delta=ws.Delta())
    middle = tmp_path / "step-000000000002.wsdelta"
    data = bytearray(middle.read_bytes())
    data[-5] ^= 0xFF  # inside the last payload: the middle delta's last tensor
    middle.write_bytes(bytes(data))
    with pytest.raises(ws.WeightStoreError) as caught:
        ws.load(tmp_path / "step-000000000003.wsdelta")
    assert caught.value.key is not None and "step-000000000003" in str(caught.value.path)
    assert published  # the anchor still reads
    ws.load(tmp_path / "step-000000000001.npz")


def test_an_anchor_damaged_after_its_deltas_were_written_is_named_by_each_of_them(tmp_path):
    """A base corrupted on disk after deltas were built on it fails each of them until the next
    anchor: each refusal, and ``ws verify``, name that one file, not only each delta's own base."""
    publish_steps(tmp_path, 4, delta=ws.Delta())
    anchor = tmp_path / "step-000000000001.npz"
    data = bytearray(anchor.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor's bytes: the file still opens
    anchor.write_bytes(bytes(data))
    for step in (2, 3, 4):
        error = refused(tmp_path / f"step-{step:012d}.wsdelta", key=None, error=ws.ChecksumError)
        assert error.message.startswith("in its chain, step-000000000001.npz: is corrupt (checksum crc32:")
        assert str(error).count("step-000000000001.npz") == 1  # said once, not as the base too
    result = subprocess.run([sys.executable, "-m", "weightstore", "verify", str(tmp_path / "step-000000000004.wsdelta")],
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "in its chain, step-000000000001.npz: is corrupt" in result.stdout + result.stderr


@pytest.mark.parametrize("cut", [3, 30, -1])
def test_a_truncated_delta_is_refused(tmp_path, cut):
    publish_steps(tmp_path, 2, delta=ws.Delta())
    path = tmp_path / "step-000000000002.wsdelta"
    data = path.read_bytes()
    path.write_bytes(data[:cut])
    with pytest.raises(ws.FormatError):
        ws.load(path)


@pytest.mark.parametrize("old, new", [(b'"lr": 0.5', b'"lr": 0.7'), (b'"created": "2', b'"created": "3')])
def test_a_changed_byte_of_a_delta_versions_metadata_is_refused(tmp_path, old, new):
    """Found by fuzzing: no tensor's digest covers the metadata or the creation time; the
    manifest's CRC-32, which the delta's head records, does."""
    ws.publish(tmp_path, {"w": np.arange(4000.0)}, step=1, metadata={"lr": 0.5}, delta=True)
    ws.publish(tmp_path, {"w": np.r_[np.arange(3999.0), 7.0]}, step=2, metadata={"lr": 0.5}, delta=True)
    path = tmp_path / "step-000000000002.wsdelta"
    assert ws.load(path)["w"][-1] == 7.0  # a delta of step 1, read whole
    data = path.read_bytes()
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, new))
    error = refused(path, key=None, error=ws.ChecksumError)
    assert "manifest is corrupt" in str(error)
    result = CliRunner().invoke(app, ["verify", str(path)])
    assert result.exit_code == 1 and "manifest is corrupt" in result.output


def _edit_head(path, edit):
    """The delta version at ``path`` with its head's fields changed by ``edit`` (given the head's dict)."""
    data = path.read_bytes()
    _, head, entries, manifest = struct.unpack_from("<8sQQQ", data)
    document = json.loads(data[32:32 + head])
    edit(document)
    new_head = json.dumps(document).encode()
    path.write_bytes(struct.pack("<8sQQQ", delta_format.MAGIC, len(new_head), entries, manifest) + new_head
                     + data[32 + head:])


def test_a_delta_written_before_the_manifest_crc_still_reads(tmp_path):
    """A delta of a writer before the manifest's CRC-32: its head has no ``manifest_crc``."""
    ws.publish(tmp_path, {"w": np.arange(4000.0)}, step=1, delta=True)
    ws.publish(tmp_path, {"w": np.r_[np.arange(3999.0), 7.0]}, step=2, metadata={"lr": 0.5}, delta=True)
    path = tmp_path / "step-000000000002.wsdelta"
    _edit_head(path, lambda head: head.pop("manifest_crc"))
    with ws.open(path) as store:
        assert store.metadata == {"lr": 0.5} and store["w"][-1] == 7.0


def test_a_delta_head_whose_manifest_crc_is_not_text_is_refused(tmp_path):
    ws.publish(tmp_path, {"w": np.arange(4000.0)}, step=1, delta=True)
    ws.publish(tmp_path, {"w": np.r_[np.arange(3999.0), 7.0]}, step=2, delta=True)
    path = tmp_path / "step-000000000002.wsdelta"
    _edit_head(path, lambda head: head.update(manifest_crc=12345678))
    assert "corrupt delta head" in str(refused(path, key=None))


def test_a_delta_of_a_tensor_the_base_lacks_is_refused(based):
    folder, w = based
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000001.npz", {"v": ("same", [], w)})
    refused(folder / "step-000000000002.wsdelta", key="v")


def test_a_delta_version_is_not_written_by_save(tmp_path):
    with pytest.raises(ws.TargetError):
        ws.save(tmp_path / "x.wsdelta", {"w": np.zeros(3)})


def test_diff_gives_each_tensors_fraction_of_changed_elements(tmp_path):
    rng = np.random.default_rng(7)
    weights = model(7)
    delta = ws.Delta()
    ws.publish(tmp_path, weights, step=1, delta=delta)
    moved = step_of(weights, rng, fraction=0.02)
    ws.publish(tmp_path, moved, step=2, delta=delta)
    result = CliRunner().invoke(app, ["diff", str(tmp_path / "step-000000000001.npz"),
                                      str(tmp_path / "step-000000000002.wsdelta"), "--json"])
    assert result.exit_code == 1, result.output
    changes = {c["key"]: c for c in json.loads(result.stdout)["changed"]}
    assert set(changes) == {"dense/kernel", "dense/bias"}
    kernel = moved["dense/kernel"].view(np.uint16) != weights["dense/kernel"].view(np.uint16)
    assert changes["dense/kernel"]["changed_fraction"] == pytest.approx(kernel.mean())
    assert 0.015 < changes["dense/kernel"]["changed_fraction"] < 0.025
    assert changes["dense/bias"]["changed_fraction"] == pytest.approx(
        np.mean(moved["dense/bias"] != weights["dense/bias"]))
    text = CliRunner().invoke(app, ["diff", str(tmp_path / "step-000000000001.npz"),
                                    str(tmp_path / "step-000000000002.wsdelta")], env={"COLUMNS": "200"}).output
    assert "of elements changed" in text


KILLED_DELTA_PUBLISHER = """
import os, signal, sys
import numpy as np
import weightstore as ws
from weightstore.sync import _stages as stages
folder, stage = sys.argv[1], sys.argv[2]
def weights(step):
    w = np.arange(20000, dtype=np.float32)
    w[:step] += 1
    return {"w": w}
delta = ws.Delta()
for step in (1, 2, 3):
    ws.publish(folder, weights(step), step=step, keep=2, delta=delta)
def hook(name):
    if name == stage:
        os.kill(os.getpid(), signal.SIGKILL)
stages.hook = hook
ws.publish(folder, weights(4), step=4, keep=2, delta=delta)
sys.exit(3)
"""


@pytest.mark.parametrize("stage", ["version-temporary", "version-written", "latest-written", "pruned"])
def test_a_delta_publisher_killed_at_each_stage_leaves_a_whole_folder(tmp_path, stage):
    import signal

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", KILLED_DELTA_PUBLISHER, str(tmp_path), stage],
                            env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    version = ws.latest(tmp_path)
    expected = 4 if stage in ("latest-written", "pruned") else 3
    assert version.step == expected
    want = np.arange(20000, dtype=np.float32)
    want[:expected] += 1
    same_bytes(ws.load(version), {"w": want})
    want[:5] = np.arange(5, dtype=np.float32) + 1
    ws.publish(tmp_path, {"w": want}, step=5, keep=2, delta=True)  # a restarted trainer: its base read back
    same_bytes(ws.load(ws.latest(tmp_path)), {"w": want})
    assert ws.latest(tmp_path).path.endswith(".wsdelta")


def test_tensors_added_removed_or_reshaped_between_versions(tmp_path):
    delta = ws.Delta()
    weights = model(8)
    ws.publish(tmp_path, weights, step=1, delta=delta)
    changed = {key: value for key, value in weights.items() if key != "embed"}  # removed
    changed["head/new"] = np.arange(12, dtype=np.int32)  # added
    changed["dense/bias"] = changed["dense/bias"].astype(np.float64)  # another dtype
    changed["mask"] = np.ones((4, 10), bool)  # another shape
    version = ws.publish(tmp_path, changed, step=2, delta=delta)
    assert version.path.endswith(".wsdelta")  # the kernel, unchanged, makes it small
    same_bytes(ws.load(version), changed)
    with ws.open(version.path) as store:
        assert isinstance(store._reader, delta_format.DeltaReader)
        codecs = {key: store._reader.codec(key) for key in store}
    assert codecs["head/new"] == codecs["dense/bias"] == codecs["mask"] == "raw"
    assert codecs["dense/kernel"] == "same"


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64", "complex128"])
@pytest.mark.parametrize("elements", [70001, 1_300_003])  # one block, or two, of a count no multiple of 8
@pytest.mark.parametrize("dense", [False, True])
def test_xor_zstd_rebuilds_every_item_size(dtype, elements, dense):
    """The XOR is byte-planed by the item size; every size (one byte: no planes) rebuilds
    bit-exact, a dense change's top plane kept apart (``xor-top``) wherever there are planes."""
    rng = np.random.default_rng(7)
    base = (rng.standard_normal(elements) * 50).astype(dtype)
    new = (base * 1.001 + 1).astype(dtype)  # every element changed: dense
    new[: elements // 3] = base[: elements // 3]  # a third unchanged: zero words in the top plane
    encoded = delta_format.encode(new.view(np.uint8), base.view(np.uint8), base.itemsize, dense=dense, sparse=False)
    assert encoded.codec == ("xor-top" if dense and base.itemsize > 1 else "xor-zstd")
    out = base.view(np.uint8).copy()
    delta_format._apply_xor(memoryview(b"".join(bytes(memoryview(part)) for part in encoded.parts)), out,
                            delta_format.BLOCK, base.itemsize, top=encoded.codec == "xor-top")
    assert out.tobytes() == new.tobytes()


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64", "complex128"])
@pytest.mark.parametrize("elements", [8191, 65536, 1_300_000])  # no whole words; words; two blocks of fp32
def test_sparse_changes_found_by_words_or_one_by_one_rebuild_every_item_size(dtype, elements):
    """The changed elements of a tensor of 16 KiB+ of 1-, 2- or 4-byte items that fill whole
    words are found among the changed 8-byte words of them: changes side by side in one word,
    at the first and last element and across a block's edge are each found once, with the XOR
    of each, as one by one, and a sparse entry of them rebuilds bit-exact."""
    rng = np.random.default_rng(12)
    base = (rng.standard_normal(elements) * 20).astype(dtype)
    new = base.copy()
    picked = rng.choice(elements, elements // 40, replace=False)
    new[np.concatenate([picked, [0, 1, 2, 3, 9, elements - 1, (4 << 20) // base.itemsize]]) % elements] += 1
    raw, held, itemsize = new.view(np.uint8).reshape(-1), base.view(np.uint8).reshape(-1), base.itemsize
    group = delta_format._group(itemsize, raw.nbytes)
    assert group == (8 // itemsize if itemsize <= 4 and elements != 8191 else 1)
    positions, values = delta_format._changes(raw, held, itemsize, group,
                                              delta_format._changed_mask(raw, held, itemsize * group))
    changed = (raw.reshape(-1, itemsize) != held.reshape(-1, itemsize)).any(axis=1).nonzero()[0]
    assert positions.tolist() == changed.tolist()
    assert values.view(np.uint8).tobytes() == (raw.reshape(-1, itemsize)[changed] ^ held.reshape(-1, itemsize)[changed]
                                               ).tobytes()
    encoded = delta_format._sparse(positions, values, itemsize, elements)
    out = held.copy()
    delta_format._apply_sparse(memoryview(b"".join(bytes(memoryview(part)) for part in encoded.parts)), out, itemsize)
    assert out.tobytes() == raw.tobytes()


def xor_top_parts(w: np.ndarray, new: np.ndarray) -> list[bytes]:
    """``new`` against ``w`` as the dense encoder writes it: table, frame, top record (parts joined)."""
    encoded = delta_format.encode(new.view(np.uint8), w.view(np.uint8), 4, dense=True)
    assert encoded.codec == "xor-top"
    return [bytes(memoryview(part)) for part in encoded.parts]


def test_an_xor_top_delta_published_reads_back_and_older_xor_zstd_still_does(tmp_path):
    """A dense fp32 step is written ``xor-top``; a version written before it (``xor-zstd``, the
    top plane inside the frame) reads as it did, its codec recorded per tensor."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal(50000).astype(np.float32)
    ws.save(tmp_path / "step-000000000001.npz", {"w": w})
    new = (w * np.float32(1.001)).astype(np.float32)
    old = delta_format._xor_zstd(new.view(np.uint8), w.view(np.uint8), [1], 4, -1)  # the dense form before
    assert old.codec == "xor-zstd"
    write_delta(tmp_path / "step-000000000002.wsdelta", "step-000000000001.npz", {"w": ("xor-zstd", old.parts, new)})
    same_bytes(ws.load(tmp_path / "step-000000000002.wsdelta"), {"w": new})
    newer = (new * np.float32(1.001)).astype(np.float32)
    write_delta(tmp_path / "step-000000000003.wsdelta", "step-000000000002.wsdelta",
                {"w": ("xor-top", xor_top_parts(new, newer), newer)},
                chain=["step-000000000002.wsdelta", "step-000000000001.npz"])
    with ws.open(tmp_path / "step-000000000003.wsdelta") as store:
        assert store._reader.codec("w") == "xor-top"
        same_bytes(dict(store.items()), {"w": newer})


def test_an_unknown_codec_is_refused_naming_the_version_and_tensor(based):
    folder, w = based
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000001.npz", {"w": ("xor-lz4", [b"\0" * 8], w)})
    assert "xor-lz4" in str(refused(folder / "step-000000000002.wsdelta"))


@pytest.mark.parametrize("damage", ["short bitmap", "values added", "values dropped", "one-byte items", "frame size"])
def test_a_damaged_xor_top_entry_is_refused(based, damage):
    """Every size in an ``xor-top`` entry is checked before it is used: the top record's length
    against what its bitmaps mark, the frame's declared size against the block's low planes."""
    folder, w = based
    new = (w * np.float32(1.001) + 1).astype(np.float32)
    table, frame, *record = xor_top_parts(w, new)
    import zstandard

    record_bytes = b"".join(record)
    if damage == "short bitmap":
        record_bytes = record_bytes[:10]
    elif damage == "values added":
        record_bytes += b"\x01"
    elif damage == "values dropped":
        record_bytes = record_bytes[:-1]
    elif damage == "frame size":
        frame = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(w.nbytes))  # all four planes
    table = struct.pack("<III", 1, len(frame), len(record_bytes))
    result = new
    if damage == "one-byte items":  # int8: no planes, so no top plane to keep apart
        result = new.view(np.int8)
        ws.save(folder / "step-000000000001.npz", {"w": w.view(np.int8)})
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000001.npz",
                {"w": ("xor-top", [table, frame, record_bytes], result)})
    message = str(refused(folder / "step-000000000002.wsdelta"))
    assert ("xor-top" in message) if damage != "frame size" else ("declare" in message)


@pytest.mark.parametrize("dense", [False, True])
def test_an_empty_tensor_is_encoded_raw_in_either_path(dense):
    """An empty tensor has no element to compare: RAW, no bytes, whichever path an estimate chose."""
    empty = np.zeros(0, np.uint8)
    encoded = delta_format.encode(empty, empty.copy(), 4, dense=dense)
    assert encoded.codec == "raw" and encoded.nbytes == 0


def test_a_step_whose_estimate_does_not_pay_is_written_full(tmp_path):
    rng = np.random.default_rng(8)
    weights = {"w": rng.standard_normal(200000).astype(np.float32), "b": rng.standard_normal(300).astype(np.float32)}
    delta = ws.Delta(anchor_every=100)
    ws.publish(tmp_path, weights, step=1, delta=delta)
    noise = {key: rng.integers(0, 2**32, value.shape, dtype=np.uint32).view(np.float32) for key, value in weights.items()}
    version = ws.publish(tmp_path, noise, step=2, delta=delta)  # nothing in common: no delta pays
    assert version.path.endswith(".npz") and delta.last_kind == "full"
    same_bytes(ws.load(version), noise)
    moved = {"w": noise["w"].copy(), "b": rng.integers(0, 2**32, 300, dtype=np.uint32).view(np.float32)}
    moved["w"].view(np.uint32)[:1000] ^= 1  # random bits hold NaNs: change bits, not values
    version = ws.publish(tmp_path, moved, step=3, delta=delta)  # "b" changed whole: raw inside the delta
    assert version.path.endswith(".wsdelta")
    same_bytes(ws.load(version), moved)


def test_a_chain_starts_at_the_newest_raw_copy_of_a_tensor(tmp_path):
    """A follower holding step 1 rebuilds step 3 from the deltas after it; a tensor step 3 stores
    whole costs its own bytes only, and reading it needs nothing older."""
    rng = np.random.default_rng(9)
    weights = {"w": rng.standard_normal(50000).astype(np.float32), "b": rng.standard_normal(5000).astype(np.float32)}
    delta = ws.Delta(anchor_every=100)
    first = ws.publish(tmp_path, weights, step=1, delta=delta)
    held = {key: value.copy() for key, value in weights.items()}
    for step in (2, 3):
        weights = {"w": weights["w"].copy(), "b": rng.integers(0, 2**32, 5000, dtype=np.uint32).view(np.float32)}
        weights["w"][step * 10] += 1
        version = ws.publish(tmp_path, weights, step=step, delta=delta)
    assert version.path.endswith(".wsdelta")
    name = Path(first.path).name
    with ws.open(version) as store:
        assert store.chain_payload(["b"], name) == weights["b"].nbytes  # step 3's raw copy, not step 2's too
        fresh = store.chain_payload(["w", "b"], None)
        assert fresh is not None and fresh > store.chain_payload(["w", "b"], name)
        for key in ("w", "b"):
            rebuilt = store.read_from(key, name, held[key].view(np.uint8))
            assert rebuilt is not None and rebuilt.tobytes() == weights[key].tobytes()



def test_dense_steps_alternate_with_anchors_and_read_bit_exact(tmp_path):
    """Each fp32 step moving every element is about half a version: a delta after each anchor,
    and an anchor where one more delta of the last's size would pass a full version."""
    rng = np.random.default_rng(10)
    weights = {"w": rng.standard_normal(100000).astype(np.float32), "b": rng.standard_normal(100).astype(np.float32)}
    delta = ws.Delta(anchor_every=20)
    kinds, published = [], []
    for step in range(1, 8):
        weights = {key: (value * (1 + rng.standard_normal(value.shape) * 1e-3)).astype(np.float32)
                   for key, value in weights.items()}
        published.append((ws.publish(tmp_path, weights, step=step, keep=10, delta=delta), weights))
        kinds.append(delta.last_kind)
    assert kinds == ["full", "delta", "full", "delta", "full", "delta", "full"]
    for version, weights in published:
        same_bytes(ws.load(version), weights)


def test_a_tensor_that_stops_changing_is_stored_same_again(tmp_path):
    """A tensor XOR-ed densely is XOR-ed straight away the next step; once it stops changing
    its XOR is nothing, and the step after it is compared first again: ``same``."""
    rng = np.random.default_rng(11)
    weights = {"w": rng.standard_normal(100000).astype(np.float32), "v": rng.standard_normal(100000).astype(np.float32)}
    delta = ws.Delta(anchor_every=20)
    ws.publish(tmp_path, weights, step=1, delta=delta)
    weights = {"w": (weights["w"] * np.float32(1.001)).astype(np.float32), "v": weights["v"]}
    version = ws.publish(tmp_path, weights, step=2, delta=delta)  # w dense, v same
    codecs = []
    for step in (3, 4):  # w stops changing: XOR-ed (nothing), then compared first: same
        version = ws.publish(tmp_path, dict(weights), step=step, delta=delta)
        assert version.path.endswith(".wsdelta")
        with ws.open(version) as store:
            codecs.append(store._reader.codec("w"))
        same_bytes(ws.load(version), weights)
    assert codecs == ["xor-top", "same"]


@pytest.mark.parametrize("damage", [None, 0, 1_500_000, 2_600_000 - 3])
def test_a_sparse_change_hashed_as_applied_rebuilds_or_is_refused(tmp_path, damage):
    """A sparse change applied onto a held copy is hashed a piece at a time as it is applied:
    over several pieces and a last partial one it rebuilds bit-exact, and a held copy damaged
    in any piece is refused with the file and the tensor named."""
    rng = np.random.default_rng(12)
    weights = {"w": rng.standard_normal(1_300_000).astype(np.float32).astype(ml_dtypes.bfloat16)}  # 2.6 MB
    delta = ws.Delta()
    first = ws.publish(tmp_path, weights, step=1, delta=delta)
    moved = weights["w"].view(np.uint16).copy()
    moved[rng.integers(0, moved.size, 20000)] += 1
    moved[-1] += 1
    version = ws.publish(tmp_path, {"w": moved.view(ml_dtypes.bfloat16)}, step=2, delta=delta)
    held = weights["w"].view(np.uint8).copy()
    if damage is not None:
        held[damage] ^= 0x40
    with ws.open(version) as store:
        assert store._reader.codec("w") == "sparse"
        if damage is None:
            rebuilt = store.read_from("w", Path(first.path).name, held, in_place=True)
            assert rebuilt is not None and rebuilt.tobytes() == moved.tobytes()
        else:
            with pytest.raises(ws.ChecksumError) as caught:
                store.read_from("w", Path(first.path).name, held, in_place=True)
            assert caught.value.key == "w" and Path(version.path).name in str(caught.value.path)


@pytest.mark.parametrize("in_place", [True, False])
def test_a_held_copy_of_another_size_is_not_rebuilt_onto_and_is_left_as_it_was(tmp_path, in_place):
    """Bytes held that are not the tensor's size (a hostile member's manifest against its index,
    a held tensor of another shape) are never taken for the rebuilt version: ``None`` (read it
    whole), whatever the newest change's codec, and the held bytes untouched."""
    weights = {"w": np.arange(1000, dtype=np.float32)}
    delta = ws.Delta()
    first = ws.publish(tmp_path, weights, step=1, delta=delta)
    version = ws.publish(tmp_path, {"w": weights["w"] + 1}, step=2, delta=delta)  # every element: raw or xor
    for held in (np.arange(999, dtype=np.float32), np.arange(1001, dtype=np.float32)):
        before = held.copy()
        with ws.open(version) as store:
            assert store.read_from("w", Path(first.path).name, held.view(np.uint8), in_place=in_place) is None
        assert held.tobytes() == before.tobytes()


def test_publishing_deltas_never_changes_the_caller_s_weights_or_the_held_copy(tmp_path):
    """The encoder shifts words in place to split them into byte planes (``_planes``): only
    arrays of its own. A user's weights and the publisher's held copy of the version before come
    out of a delta of every codec (sparse, XOR + zstd, dense, raw) with their bytes unchanged."""
    rng = np.random.default_rng(4)
    base = rng.standard_normal((64, 1024)).astype(np.float32)
    changes = {"sparse": base.copy(), "xor": base * np.float32(1.0001), "raw": rng.integers(0, 2**32, base.shape, np.uint32)
               .view(np.float32)}
    changes["sparse"][::7, ::5] += 1
    for name, new in changes.items():
        before = new.tobytes(), base.tobytes()
        for dense in (False, True):
            found = delta_format.encode(new.reshape(-1).view(np.uint8), base.reshape(-1).view(np.uint8), 4,
                                        dense=dense)
            assert (new.tobytes(), base.tobytes()) == before, (name, dense)
        assert found.codec == {"sparse": "xor-top", "xor": "xor-top", "raw": "raw"}[name], (name, found.codec)
    assert delta_format.encode(changes["sparse"].reshape(-1).view(np.uint8), base.reshape(-1).view(np.uint8),
                               4).codec == "sparse"
    gaps = np.arange(1, 9, dtype="<u4")
    assert delta_format._planes(gaps, 4).tobytes() == gaps.view(np.uint8).reshape(-1, 4).T.tobytes()
    assert gaps.tolist() == list(range(1, 9))

    folder, planner = tmp_path / "run", ws.Delta()
    weights = {"w": base}
    for step, new in enumerate(changes.values(), start=1):
        weights = {"w": new}
        kept = {key: value.tobytes() for key, value in weights.items()}
        ws.publish(folder, weights, step=step, delta=planner)
        assert {key: value.tobytes() for key, value in weights.items()} == kept, step
        held = planner._held
        assert held is not None and (not held.current or held.tensors["w"].data.tobytes() == kept["w"]), step
        same_bytes(ws.load(ws.latest(folder)), weights)


def test_an_xor_top_record_marking_a_byte_past_its_plane_is_refused(tmp_path):
    """The top plane is recorded in whole 8-byte words: a record that marks one of the last
    word's padding bytes would change a byte past the tensor's block; refused, naming it."""
    w = np.arange(1001, dtype=np.float32)
    ws.save(tmp_path / "step-000000000001.npz", {"w": w})
    new = (w * np.float32(1.001) + 1).astype(np.float32)
    table, frame, *record = xor_top_parts(w, new)
    words = -(-1001 // 8)
    marked = np.zeros(words, bool)
    marked[-1] = True  # the last word: byte 1000 is the plane's, bytes 1001-1007 padding
    record_bytes = np.packbits(marked).tobytes() + bytes([0b01000000]) + b"\x01"  # its byte 1001
    table = struct.pack("<III", 1, len(frame), len(record_bytes))
    write_delta(tmp_path / "step-000000000002.wsdelta", "step-000000000001.npz",
                {"w": ("xor-top", [table, frame, record_bytes], new)})
    assert "byte 1001" in str(refused(tmp_path / "step-000000000002.wsdelta"))


def test_a_delta_with_an_xor_top_entry_says_it_is_newer_to_a_reader_from_before_it(based, monkeypatch):
    """Only a file holding an xor-top entry is of head version 2: a reader that knows version 1
    alone refuses it as newer than itself, not as corrupt, and still reads every other delta."""
    folder, w = based
    new = (w * np.float32(1.001) + 1).astype(np.float32)
    write_delta(folder / "step-000000000002.wsdelta", "step-000000000001.npz", {"w": ("xor-top", xor_top_parts(w, new), new)})
    changed = w.copy()
    changed[7] += 1
    small = delta_format.encode(changed.view(np.uint8), w.view(np.uint8), 4)
    assert small.codec == "xor-zstd"
    write_delta(folder / "step-000000000003.wsdelta", "step-000000000001.npz", {"w": (small.codec, small.parts, changed)})
    same_bytes(ws.load(folder / "step-000000000002.wsdelta"), {"w": new})
    monkeypatch.setattr(delta_format, "VERSIONS", (1,))  # a reader from before xor-top
    assert "format version 2, which this weightstore does not read" in str(
        refused(folder / "step-000000000002.wsdelta", key=None))
    same_bytes(ws.load(folder / "step-000000000003.wsdelta"), {"w": changed})


def test_a_hostile_xor_top_record_is_decoded_in_about_a_block_of_memory():
    """A top record that marks every byte of a block's top plane (a hostile file: 2-byte items,
    each changed) is decoded in slices: its positions never take more than about a block's bytes,
    where held whole they took 13x the block (two threads decode at once)."""
    import tracemalloc

    import zstandard

    block, itemsize = 32 << 20, 2
    count = block // itemsize
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(block - count))
    words = -(-count // 8)
    record = np.packbits(np.ones(words, bool)).tobytes() + b"\xff" * words + b"\x01" * count
    payload = struct.pack("<III", 1, len(frame), len(record)) + frame + record
    out = np.zeros(block, np.uint8)
    tracemalloc.start()
    try:
        delta_format._apply_xor(memoryview(payload), out, block, itemsize, top=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < block * 3 // 2, peak  # the low planes decoded (half the block here), and a slice
    assert out[itemsize - 1 :: itemsize].min() == 1 and out[::itemsize].max() == 0


@pytest.mark.parametrize("dtype", [np.int8, np.float32])
def test_a_dense_change_with_its_top_plane_in_the_frame_is_not_compressed_at_the_xor_top_level(dtype):
    """Level -4 pays only where the top plane is kept apart: a dense change of 1-byte items, or of
    a tensor too small to keep it apart, is compressed at level -1 (int8: 11% fewer bytes)."""
    rng = np.random.default_rng(0)
    size = 1 << 20 if dtype == np.int8 else 256
    base = rng.integers(-100, 100, size).astype(dtype)
    new = (base + rng.integers(-2, 3, size)).astype(dtype)
    encoded = delta_format.encode(new.view(np.uint8), base.view(np.uint8), base.itemsize, dense=True)
    assert encoded.codec == "xor-zstd"
    at_top_level = delta_format._xor_zstd(new.view(np.uint8), base.view(np.uint8), [1], base.itemsize, -4)
    assert encoded.nbytes < at_top_level.nbytes
    assert bytes(b"".join(bytes(memoryview(part)) for part in encoded.parts)) == b"".join(
        bytes(memoryview(part)) for part in delta_format._xor_zstd(
            new.view(np.uint8), base.view(np.uint8), [1], base.itemsize, -1).parts)


def test_a_chain_deeper_than_the_stack_allowed_reads_back_from_a_deep_caller(tmp_path):
    """A reader opens, rebuilds and closes a chain in loops, not each base inside the one above
    (about five Python frames a base): a chain of small deltas past about 165 passed Python's
    1,000 frames, and every fresh follower, ``ws.load`` and ``ws verify`` called the sound chain
    corrupt ("delta head is not JSON (maximum recursion depth exceeded)"), or leaked a bare
    RecursionError. A chain of 200 (``anchor_every=201``, as a publisher of the last release may
    have written, and may still) reads back, even from a caller 300 frames deep (a callback
    inside ``fit``); ``anchor_every`` past the deepest chain a reader follows is refused."""
    from weightstore.core.limits import MAX_DELTA_CHAIN

    with pytest.raises(ValueError, match=f"anchor_every must be an int from 1 to {MAX_DELTA_CHAIN + 1}"):
        ws.Delta(anchor_every=MAX_DELTA_CHAIN + 2)
    deltas = 200
    delta = ws.Delta(anchor_every=deltas + 1)
    weights = {"w": np.zeros(4096, np.float32)}
    for step in range(1, deltas + 3):
        weights["w"][step] += 1
        ws.publish(tmp_path, weights, step=step, delta=delta, keep=None)
    kinds = [path.suffix for path in sorted(tmp_path.glob("step-*"))]
    assert kinds == [".npz"] + [".wsdelta"] * deltas + [".npz"]  # the next version anchors

    def deep(frames: int) -> dict:
        return deep(frames - 1) if frames else ws.load(tmp_path / f"step-{deltas + 1:012d}.wsdelta")

    expected = np.zeros(4096, np.float32)
    expected[1:deltas + 2] = 1
    assert np.array_equal(deep(300)["w"], expected)
    if os.path.isdir("/proc/self/fd"):  # closing it closes every file of its chain, each held open

        def chain_files_open() -> int:  # descriptors on the folder's files: other threads open and close their own
            count = 0
            for fd in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):  # closed since it was listed (the listing's own)
                    count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
            return count

        assert chain_files_open() == 0
        with ws.open(tmp_path / f"step-{deltas + 1:012d}.wsdelta") as store:
            assert chain_files_open() >= deltas  # the anchor's may be closed once mapped
        assert chain_files_open() == 0, store
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 0, result.output


def test_a_base_missing_deep_in_a_chain_is_named_once(tmp_path):
    """A chain's bases are opened in a loop, and one that fails is named once from the version
    read: nested once a base, an anchor pruned by hand below 130 deltas made a 4 KB message for
    each of them, and ``ws verify`` of the folder printed 370 KB."""
    delta = ws.Delta(anchor_every=20)
    weights = {"w": np.zeros(4096, np.float32)}
    for step in range(1, 13):
        weights["w"][step] += 1
        ws.publish(tmp_path, weights, step=step, delta=delta, keep=None)
    assert [path.suffix for path in sorted(tmp_path.glob("step-*"))] == [".npz"] + [".wsdelta"] * 11
    (tmp_path / "step-000000000001.npz").unlink()
    with pytest.raises(ws.FormatError) as caught:
        ws.load(tmp_path / "step-000000000012.wsdelta")
    assert caught.value.path.endswith("step-000000000012.wsdelta")
    assert caught.value.message == ("in its chain, step-000000000002.wsdelta: needs its base step-000000000001.npz, "
                                    "which is missing (pruned by hand, or never copied with it)")


def test_a_chain_is_held_in_memory_linear_in_its_depth(tmp_path):
    """Each head of a chain lists every base below it: checked name by name and kept as parsed,
    in every head, a chain of 1,000 took half a million name matches to open (0.85 s) and held
    46 MB of names. A base's chain equal to what the head above it says is taken as checked
    there, and held as that list: a version 160 deep holds about what 40 deep does per delta."""
    import tracemalloc

    delta = ws.Delta(anchor_every=200)
    weights = {"w": np.zeros(1 << 16, np.float32)}
    for step in range(1, 162):
        weights["w"][step] += 1
        ws.publish(tmp_path, weights, step=step, delta=delta, keep=None)
    assert [path.suffix for path in sorted(tmp_path.glob("step-*"))] == [".npz"] + [".wsdelta"] * 160

    def held_per_delta(depth: int) -> float:
        tracemalloc.start()
        try:
            with ws.open(tmp_path / f"step-{depth + 1:012d}.wsdelta") as store:
                held = tracemalloc.get_traced_memory()[0]
                assert store["w"][depth] == 1
        finally:
            tracemalloc.stop()
        return held / depth

    assert held_per_delta(160) < 1.3 * held_per_delta(40)


def dense_steps(rng: np.random.Generator, weights: dict[str, np.ndarray], count: int):
    """``count`` fp32 Adam-like steps: every element of every tensor moves a little."""
    for _ in range(count):
        weights = {key: value + np.float32(1e-3) * rng.standard_normal(value.shape).astype(np.float32)
                   for key, value in weights.items()}
        yield weights


def test_a_dense_delta_is_made_in_the_memory_of_the_base_it_spends_and_decodes():
    """``encode(spend=True)``: each block's frame and top record are moved into the base's bytes
    of that block (the publisher's own copy, read already), not held in fresh memory until written;
    they decode to the new bytes as the compressor's output does."""
    rng = np.random.default_rng(6)
    base = rng.standard_normal(3 * (1 << 20) - 1024).astype(np.float32)  # three 4 MiB blocks, the last short
    new = base + np.float32(1e-3) * rng.standard_normal(base.shape).astype(np.float32)
    flat_new, flat_base = new.view(np.uint8), base.copy().view(np.uint8)
    kept = delta_format.encode(flat_new, flat_base.copy(), 4, dense=True)
    spent = delta_format.encode(flat_new, flat_base, 4, dense=True, spend=True)
    assert spent.codec == kept.codec == "xor-top"
    assert b"".join(map(bytes, spent.parts)) == b"".join(map(bytes, kept.parts))
    assert all(np.shares_memory(np.frombuffer(part, np.uint8), flat_base) for part in spent.parts[1:])
    assert not any(np.shares_memory(np.frombuffer(part, np.uint8), flat_base) for part in kept.parts)


@contextlib.contextmanager
def disk_full_once_locked():
    """The next publish fails at the folder's lock, once its delta is encoded: the disk is full."""
    from weightstore.sync import _stages as stages

    def fail(name: str) -> None:
        if name == "locked":
            raise OSError(28, "No space left on device")

    stages.hook = fail
    try:
        yield
    finally:
        stages.hook = None


def test_a_publish_that_fails_after_spending_its_base_is_followed_by_versions_that_read_back(tmp_path):
    """A delta is made in the memory of the publisher's copy of its base: a publish that fails
    once it is encoded (here: at the folder's lock) leaves no base in memory, so the next is
    written full, not encoded against the payload left there, and every version reads back."""
    rng = np.random.default_rng(7)
    folder, planner = tmp_path / "run", ws.Delta(anchor_every=20)
    steps = list(dense_steps(rng, {"w": rng.standard_normal((512, 2048)).astype(np.float32)}, 4))
    ws.publish(folder, steps[0], step=1, delta=planner)

    with pytest.raises(OSError, match="No space"), disk_full_once_locked():
        ws.publish(folder, steps[1], step=2, delta=planner)
    for step, weights in enumerate(steps[1:], start=2):
        version = ws.publish(folder, weights, step=step, delta=planner)
        same_bytes(ws.load(version), weights)
    assert files(folder) == ["step-000000000001.npz", "step-000000000002.npz", "step-000000000003.wsdelta",
                             "step-000000000004.npz"]


def test_a_publish_that_fails_after_a_sparse_delta_is_followed_by_a_delta_from_memory(tmp_path):
    """A sparse step's delta (bf16, 2% of the elements) is made in fresh memory, not in the
    publisher's copy of its base: a publish that fails once it is encoded leaves that copy the
    base's, so the retry is a delta again, not a full version, and reads back."""
    rng = np.random.default_rng(12)
    weights = rng.standard_normal((2048, 1024)).astype(ml_dtypes.bfloat16)
    steps = [weights]
    for _ in range(2):  # a bf16 step: 2% of the elements move by their last mantissa bit
        weights = weights.copy()
        weights.view(np.uint16).reshape(-1)[rng.integers(0, weights.size, weights.size // 50)] ^= 1
        steps.append(weights)
    planner = ws.Delta(anchor_every=20)
    ws.publish(tmp_path, {"w": steps[0]}, step=1, delta=planner)
    ws.publish(tmp_path, {"w": steps[1]}, step=2, delta=planner)

    with pytest.raises(OSError, match="No space"), disk_full_once_locked():
        ws.publish(tmp_path, {"w": steps[2]}, step=3, delta=planner)
    version = ws.publish(tmp_path, {"w": steps[2]}, step=3, delta=planner)
    assert files(tmp_path) == ["step-000000000001.npz", "step-000000000002.wsdelta", "step-000000000003.wsdelta"]
    same_bytes(ws.load(version), {"w": steps[2]})


def test_a_delta_written_while_the_same_delta_publishes_elsewhere_reads_back(tmp_path):
    """Two publishes given one ``Delta`` overlap (a background publisher and a foreground one):
    the first's payload lies in the memory of the remembered copy it spent, which the second,
    finishing first, must not copy its weights into; the first's version reads back whole."""
    import threading

    from weightstore.sync import _stages as stages

    rng = np.random.default_rng(8)
    planner = ws.Delta(anchor_every=20)
    steps = list(dense_steps(rng, {"w": rng.standard_normal((512, 2048)).astype(np.float32)}, 2))
    ws.publish(tmp_path / "a", steps[0], step=1, delta=planner)
    encoded, release = threading.Event(), threading.Event()

    def hold(name: str) -> None:
        if name == "locked" and threading.current_thread().name == "first":
            encoded.set()
            release.wait(60)

    found: list[BaseException | ws.Version] = []
    first = threading.Thread(target=lambda: found.append(ws.publish(tmp_path / "a", steps[1], step=2, delta=planner)),
                             name="first")
    stages.hook = hold
    try:
        first.start()
        assert encoded.wait(60)
        other = ws.publish(tmp_path / "b", steps[0], step=1, delta=planner)  # done while the first is held
    finally:
        release.set()
        first.join(60)
        stages.hook = None
    same_bytes(ws.load(other), steps[0])
    assert found and found[0].path.endswith(".wsdelta")
    same_bytes(ws.load(found[0]), steps[1])


@pytest.mark.parametrize(("change", "codec"), [("dense", "xor-top"), ("xor", "xor-zstd"), ("raw", "raw")])
def test_an_xor_encode_gives_the_crc_of_the_new_bytes_it_took_in_passing(change, codec):
    """A tensor XOR-ed in blocks is checksummed block by block as it is XOR-ed (the block in
    cache), not in a pass of its own: the CRC-32 it gives is the new bytes', also where the XOR
    did not pay (raw)."""
    rng = np.random.default_rng(9)
    base = rng.standard_normal(3 * (1 << 20) + 7).astype(np.float32)
    new = {"dense": base + np.float32(1e-3) * rng.standard_normal(base.shape).astype(np.float32),
           "xor": base * np.float32(1.0001),
           "raw": rng.integers(0, 2**32, base.shape, np.uint32).view(np.float32)}[change]
    new.view(np.uint32)[::3001] ^= 1
    found = delta_format.encode(new.view(np.uint8), base.view(np.uint8), 4, dense=change == "dense", sparse=False)
    assert found.codec == codec and found.crc == crc32(new.view(np.uint8))


@pytest.mark.parametrize("change", ["noise", "rows", "heads"])
def test_noise_low_planes_are_written_as_stored_zstd_blocks_and_rebuild(change):
    """An fp32 Adam step's low byte planes are noise: a spent dense block writes them as a zstd
    frame of stored blocks (what zstd would make of them, without its search for matches), any
    zstd decoder reads it, and the block rebuilds; planes that do shrink (rows that did not
    change, every other one or spans of them: pruned heads, a quarter of the block) are still
    compressed."""
    rng = np.random.default_rng(10)
    base = rng.standard_normal(2 * (1 << 20) - 4096).astype(np.float32)  # two blocks
    new = base * (1 + np.float32(0.05) * rng.standard_normal(base.shape).astype(np.float32))  # 5%: small weights, Adam
    if change == "rows":
        new[::2] = base[::2]  # every other element unchanged: zeros zstd finds
    if change == "heads":
        for first in (3, 11):  # two spans of 128 rows of 1,024 elements unchanged, a quarter of the first block
            new[first << 16 : (first + 2) << 16] = base[first << 16 : (first + 2) << 16]
    spent = delta_format.encode(new.view(np.uint8), base.copy().view(np.uint8), 4, dense=True, spend=True)
    assert spent.codec == "xor-top"
    table = np.frombuffer(bytes(spent.parts[0]), "<u4")
    frame = bytes(spent.parts[1])
    low = 3 * (1 << 20)  # the first block's three low planes
    stored = frame[4] == 0xE0 and len(frame) == 13 + 3 * 24 + low
    assert stored == (change == "noise") and table[1] == len(frame)
    assert len(zstandard.ZstdDecompressor().decompress(frame)) == low
    out = base.view(np.uint8).copy()
    delta_format._apply_xor(memoryview(b"".join(bytes(memoryview(part)) for part in spent.parts)), out,
                            delta_format.BLOCK, 4, top=True)
    assert out.tobytes() == new.view(np.uint8).tobytes()


def test_a_delta_pickles_and_deep_copies_and_the_copy_publishes_deltas(tmp_path):
    """A ``Delta`` handed to a spawned process is pickled, and one kept in a trainer's config may
    be deep-copied: its lock (which hands the remembered copy's memory between publishes) is
    not copied, the copy gets its own, and its memory of the last version is its own too."""
    import copy
    import pickle

    weights = np.random.default_rng(11).standard_normal((512, 2048)).astype(np.float32)
    steps = [{"w": weights + np.float32(step) * (np.arange(weights.size) % 97 == 0).reshape(weights.shape)}
             for step in range(3)]  # 1% of the elements change a step: deltas, no anchor due
    assert pickle.loads(pickle.dumps(ws.Delta(anchor_every=7))).anchor_every == 7
    planner = ws.Delta(anchor_every=20)
    ws.publish(tmp_path, steps[0], step=1, delta=planner)
    twin = copy.deepcopy(planner)
    for step, delta in ((2, twin), (3, planner)):  # the twin from its memory, the original from the folder
        version = ws.publish(tmp_path, steps[step - 1], step=step, delta=delta)
        assert version.path.endswith(".wsdelta")
        same_bytes(ws.load(version), steps[step - 1])
