"""The TF1 examples run as the README shows them, and show what they claim.

``python -m examples.tf1_ensemble`` is run in ``test_examples_keras``, in the one fresh
interpreter that also runs the Keras ensemble (TensorFlow imported once for both).
"""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

from examples import tf1_ensemble, tf1_selective, tf1_sync  # noqa: E402


@pytest.mark.slow
def test_sync_follows_versions_in_another_process_without_growing_its_graph(tmp_path, capsys):
    seen = tf1_sync.main(str(tmp_path), steps=60, every=20)
    # PublishHook: the first step, then every 20, then the last; the reader sees each once, in order
    steps = [entry["step"] for entry in seen]
    assert steps == [None, 1, 21, 41, 60]
    outputs = [entry["output"] for entry in seen]
    assert len(set(outputs)) == len(outputs)  # every version changed the output
    distance = [abs(output - 9.0) for output in outputs]  # the trainer's target: 2 * sum(ones(4)) + 1
    assert distance == sorted(distance, reverse=True)
    assert len({entry["ops"] for entry in seen}) == 1  # finalized graph, no op added by any reload
    assert seen[1]["assigned"] == ["body/b", "body/w", "head/b", "head/w"] and seen[1]["skipped"] == []
    for entry in seen[2:]:  # the frozen body's checksums never change: hot reload writes the head only
        assert entry["assigned"] == ["head/b", "head/w"] and entry["skipped"] == ["body/b", "body/w"]
    assert sorted(path.name for path in (tmp_path / "versions").glob("step-*")) == [
        f"step-{step:012d}.npz" for step in steps[-2:]]  # keep=2
    assert "skipped 2 ['body/b', 'body/w']" in capsys.readouterr().out


def test_ensemble_prints_11_12_13(tmp_path, capsys):
    assert tf1_ensemble.main(str(tmp_path)) == [11.0, 12.0, 13.0]
    out = capsys.readouterr().out
    assert "x = 10 -> 11, 12, 13" in out
    assert "did you mean 'model_002/w'?" in out


def test_selective_restore_gives_identical_predictions(tmp_path):
    result = tf1_selective.main(str(tmp_path))
    assert result["identical"] and result["kept_initial"]
    assert result["ratio"] < 0.7
    assert result["untouched"] == result["left_out"]
    assert all(key.endswith("/Adagrad") for key in result["left_out"] if key != "global_step")
    assert {"conv_1/bn/moving_mean", "conv_2/bn/moving_variance"}.isdisjoint(result["left_out"])

