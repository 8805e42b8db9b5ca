"""Tensors are "unchanged" only when their bytes are: a content digest, never a CRC-32.

A CRC-32 collision is four chosen bytes away (:func:`forge_crc32_collision`). Hot reload and
``ws diff`` decide on the BLAKE3 digest every file of manifest version 3 records per tensor;
files written before it are compared by their bytes. The TF2 model is a real Keras model and
``ws diff`` the real command.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from crc_forge import forge_crc32_collision
from typer.testing import CliRunner

import weightstore as ws
from weightstore.cli.main import app
from weightstore.core.manifest import content_digest

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def collision() -> tuple[np.ndarray, np.ndarray]:
    original = np.linspace(-1, 1, 4 * 8, dtype=np.float32).reshape(4, 8)
    return original, forge_crc32_collision(original, 5.0)


def test_the_forged_pair_has_one_crc32_and_two_digests(collision, tmp_path):
    a, b = collision
    first, second = ws.publish(tmp_path, {"w": a}, step=1), ws.publish(tmp_path, {"w": b}, step=2)
    with ws.open(first) as left, ws.open(second) as right:
        assert left.info("w").checksum == right.info("w").checksum  # the CRC-32 in the manifest agrees
        assert left.info("w").digest != right.info("w").digest
        assert left.info("w").digest == "blake3:" + content_digest(a).hex()


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors"])
def test_a_plain_save_records_crc32s_but_no_digests(collision, tmp_path, suffix):
    """A plain save leaves the digest out (only a comparison needs it, and it costs a pass over
    every byte): its manifest is version 2, which older readers read, and every read still
    verifies the CRC-32. A version (what followers compare) records digests."""
    a, _ = collision
    ws.save(tmp_path / f"a{suffix}", {"w": a})
    with ws.open(tmp_path / f"a{suffix}") as store:
        assert store.info("w").digest is None and store.info("w").checksum is not None
        assert store.has_checksums and np.array_equal(store["w"], a)
    with ws.open(ws.publish(tmp_path / "versions", {"w": a}, step=1, format={".h5": "hdf5"}.get(suffix, suffix[1:]))) as version:
        assert version.info("w").digest == "blake3:" + content_digest(a).hex()


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors"])
def test_ws_diff_reports_a_forged_crc32_collision(collision, tmp_path, suffix):
    a, b = collision
    ws.save(tmp_path / f"a{suffix}", {"w": a, "same": a})
    ws.save(tmp_path / f"b{suffix}", {"w": b, "same": a})
    result = CliRunner().invoke(app, ["diff", str(tmp_path / f"a{suffix}"), str(tmp_path / f"b{suffix}"), "--json"])
    assert result.exit_code == 1, result.output
    assert '"key": "w"' in result.output and '"unchanged": 1' in result.output


def test_ws_diff_says_equal_only_for_equal_bytes(tmp_path):
    """-0.0 and 0.0 are equal values but other bytes: at atol 0 that is a change ("bytes")."""
    ws.save(tmp_path / "a.npz", {"w": np.zeros(3, np.float32)})
    ws.save(tmp_path / "b.npz", {"w": np.array([0.0, -0.0, 0.0], np.float32)})
    result = CliRunner().invoke(app, ["diff", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--json"])
    assert result.exit_code == 1 and '"reason": "bytes"' in result.output
    tolerant = CliRunner().invoke(app, ["diff", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--atol", "1e-9"])
    assert tolerant.exit_code == 0  # a tolerance compares values


def test_files_without_digests_are_compared_by_bytes(tmp_path):
    """Golden version 2 files carry CRC-32s only: diff reads them, and finds them equal."""
    older = DATA / "golden_v2.npz"
    with ws.open(older) as store:
        assert all(store.info(key).digest is None for key in store)
        ws.save(tmp_path / "now.npz", store)
    for pair in ([older, DATA / "golden_v2_compressed.npz"], [older, tmp_path / "now.npz"]):
        result = CliRunner().invoke(app, ["diff", *map(str, pair)])
        assert result.exit_code == 0, result.output


def test_a_background_publisher_leaves_digests_out_only_where_every_tensor_changed(collision, tmp_path):
    """A trainer's versions, every tensor's CRC-32 changed since the last, carry no digests (none
    could match, and hashing was most of a publish's CPU); a version where one CRC-32 did not
    change, the forged one included, carries every tensor's, correct, whatever was guessed."""
    a, b = collision
    steps = [{"w": a * step, "bias": np.full(3, step, np.float32)} for step in range(1, 5)]
    steps += [{"w": a * 4, "bias": np.full(3, 5, np.float32)},  # w unchanged since step 4
              {"w": a, "bias": np.full(3, 6, np.float32)}, {"w": b, "bias": np.full(3, 7, np.float32)}]  # b: a's CRC-32
    with ws.BackgroundPublisher(tmp_path, keep=None) as publisher:
        versions = [publisher.publish(weights, step=step).result(60) for step, weights in enumerate(steps, 1)]
    recorded = []
    for version, weights in zip(versions, steps, strict=True):
        with ws.open(version) as store:
            assert all(np.array_equal(store[key], value) for key, value in weights.items())
            digests = {key: store.info(key).digest for key in weights}
        recorded.append(digests["w"] is not None)
        if digests["w"] is not None:
            assert digests == {key: "blake3:" + content_digest(value).hex() for key, value in weights.items()}
        else:
            assert set(digests.values()) == {None}
    # 1: nothing to compare with; 2, 6: all changed, hashed on the guess from 1, 5; 3, 4: all changed;
    # 5, 7: one CRC-32 the same (7's forged)
    assert recorded == [True, True, False, False, True, True, True]


# -- hot reload ---------------------------------------------------------------------------------

tf = pytest.importorskip("tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def test_hot_reload_writes_a_tensor_whose_crc32_was_forged(collision, tmp_path):
    from weightstore.adapters import tf2

    a, b = collision
    variables = {"w": tf.Variable(np.zeros_like(a)), "bias": tf.Variable(np.zeros(3, np.float32))}
    bias = np.ones(3, np.float32)
    first = tf2.assign(variables, ws.publish(tmp_path, {"w": a, "bias": bias}, step=1))
    assert sorted(first.assigned) == ["bias", "w"]
    second = tf2.assign(variables, ws.publish(tmp_path, {"w": b, "bias": bias}, step=2))
    assert second.assigned == ["w"] and second.skipped == ["bias"]  # bias unchanged: skipped by its digest
    assert variables["w"].numpy().tobytes() == b.tobytes()


def test_hot_reload_of_a_file_without_digests_writes_every_tensor(tmp_path):
    from weightstore.adapters import tf2

    older = DATA / "golden_v2.npz"
    with ws.open(older) as store:
        values = {key: tf.Variable(np.zeros(store.info(key).shape, store.info(key).dtype))
                  for key in ["model_001/dense/kernel", "w"]}
    for _ in range(2):
        report = tf2.assign(values, older, include=list(values), strict=False, skip_unchanged=True)
        assert sorted(report.assigned) == sorted(values) and report.skipped == []
