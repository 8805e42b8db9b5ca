"""The Keras examples run as the README shows them, and show what they claim."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

from examples import keras_ensemble, keras_selective, keras_sync  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_sync_follower_swaps_versions_in_another_process_while_it_serves(tmp_path, capsys):
    seen = keras_sync.main(str(tmp_path), steps=12, every=4)
    assert [entry["step"] for entry in seen] == [None, 4, 8, 12]  # each version once, in order
    outputs = [entry["output"] for entry in seen]
    assert len(set(outputs)) == len(outputs)  # every version changed the output
    assert all(entry["assigned"] == 4 and entry["skipped"] == 0 for entry in seen[1:])  # the whole model trains
    path, key = seen[0]["paths"]
    assert key == "dense/kernel" and path != "sequential/dense/kernel"  # other Keras names, same key
    assert sorted(path.name for path in (tmp_path / "versions").glob("step-*")) == [
        "step-000000000004.npz", "step-000000000008.npz", "step-000000000012.npz"]  # keep=3
    assert "trainer: published step  12 -> reader: output" in capsys.readouterr().out


def test_ensemble_prints_11_12_13(tmp_path, capsys):
    assert keras_ensemble.main(str(tmp_path)) == {"keras": [11.0, 12.0, 13.0], "module": [11.0, 12.0, 13.0]}
    out = capsys.readouterr().out
    assert "keras  with x = 10: 11, 12, 13" in out and "module with x = 10: 11, 12, 13" in out
    assert "['model_001/w', 'model_002/w', 'model_003/w']" in out


def test_selective_restore_gives_identical_predictions(tmp_path):
    result = keras_selective.main(str(tmp_path))
    assert result["identical"] and result["kept_initial"] and result["stats_matter"]
    assert result["ratio"] < 0.7
    assert {"conv_1/bn/moving_mean", "conv_2/bn/moving_variance", "conv_1/conv/kernel", "logits/bias"} <= set(
        result["assigned"])


# each module run as ``python -m`` runs it (runpy, as __main__), one after the other in one process
# of their own, forked from one that imported TensorFlow (``conftest.tf_fork``): TensorFlow's
# import, most of the cost, is paid once for this worker's processes
AS_MODULES = """
import runpy
for name in ("examples.keras_ensemble", "examples.tf1_ensemble"):
    runpy.run_module(name, run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_examples_run_as_modules(tf_fork):
    done = tf_fork.run(AS_MODULES, cwd=ROOT, timeout=180, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr
    keras_part, tf1_part = done.stdout.split("member_1.npz holds", 1)  # the TF1 ensemble's first line
    assert "keras  with x = 10: 11, 12, 13" in keras_part
    assert "x = 10 -> 11, 12, 13" in tf1_part
