"""keras-hub's files, written here by keras-hub itself from small configs (random weights, no
download): ``save_to_preset`` folders of backbones (one file or sharded) and of tasks (with
and without weights of their own), and ``save_lora_weights`` files,
assigned with one call and compared with what keras-hub's own loaders make of them."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
if importlib.util.find_spec("keras_hub") is None:
    pytest.skip("keras_hub is not installed", allow_module_level=True)
#: keras-hub, imported by this module's first test (:func:`_keras_hub`), not as it is collected:
#: each ``./tasks test`` worker imports every test module to collect it, and keras-hub (with
#: tensorflow-text) cost 0.8 CPU-s in the workers that run none of its tests
keras_hub: ModuleType

import weightstore as ws  # noqa: E402
from weightstore.adapters import tf2  # noqa: E402

RNG = np.random.default_rng(39)
INPUTS = {"token_ids": RNG.integers(0, 50, (2, 16)), "segment_ids": np.zeros((2, 16), "int32"),
          "padding_mask": np.ones((2, 16), "int32")}


@pytest.fixture(scope="module", autouse=True)
def _keras_hub() -> None:
    global keras_hub
    import keras_hub


def bert():
    return keras_hub.models.BertBackbone(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=8,
                                         intermediate_dim=16, max_sequence_length=16)


def outputs(backbone):
    return {name: np.asarray(value) for name, value in backbone(INPUTS).items()}


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    """name -> a preset folder of one BERT backbone: in one file, and sharded."""
    root = tmp_path_factory.mktemp("presets")
    backbone = bert()
    backbone.save_to_preset(str(root / "single"))
    backbone.save_to_preset(str(root / "sharded"), max_shard_size=2e-6)  # GB: some 2 KB a shard
    return {"single": str(root / "single"), "sharded": str(root / "sharded")}


@pytest.mark.parametrize("kind", ["single", "sharded"])
@pytest.mark.slow  # a KerasHub model built each
def test_a_preset_folder_assigns_as_from_preset_loads_it(presets, kind):
    folder = presets[kind]
    weights = "model.weights.h5" if kind == "single" else "model.weights.json"
    with ws.open(folder) as store:
        assert store.path.endswith(weights)
        assert any(key.endswith("/vars/0") for key in store)
    fresh = bert()
    report = tf2.assign(fresh, folder)
    assert report.ok and len(report.assigned) == len(fresh.weights)
    loaded = outputs(keras_hub.models.Backbone.from_preset(folder))
    for name, value in outputs(fresh).items():
        np.testing.assert_array_equal(value, loaded[name])


def classifier():
    return keras_hub.models.BertTextClassifier(backbone=bert(), num_classes=3, preprocessor=None)


def causal_lm():
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=16)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


@pytest.mark.parametrize(("make", "loader", "inputs", "task_file"), [
    (classifier, "TextClassifier", INPUTS, True),  # a head of its own: task.weights.h5
    (causal_lm, "CausalLM", {"token_ids": INPUTS["token_ids"], "padding_mask": INPUTS["padding_mask"]}, False),
])
def test_a_task_preset_assigns_as_task_from_preset_loads_it(tmp_path, make, loader, inputs, task_file):
    folder = str(tmp_path / "task")
    make().save_to_preset(folder)
    assert (tmp_path / "task" / "task.weights.h5").exists() == task_file
    fresh = make()
    report = tf2.assign(fresh, folder)
    assert report.ok and len(report.assigned) == len(fresh.weights)
    loaded = getattr(keras_hub.models, loader).from_preset(folder)
    np.testing.assert_array_equal(np.asarray(fresh(inputs)), np.asarray(loaded(inputs)))
    backbone_only = make().backbone
    assert tf2.assign(backbone_only, folder).ok  # ws.open(folder) is the backbone's weights
    with ws.open(folder) as store:
        assert len(store) == len(backbone_only.weights)


def test_a_task_preset_into_a_task_with_another_head_is_refused_naming_the_folder(tmp_path):
    folder = str(tmp_path / "task")
    classifier().save_to_preset(folder)
    other = keras_hub.models.BertTextClassifier(backbone=bert(), num_classes=5, preprocessor=None)
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(other, folder)
    assert str(caught.value).startswith(f"{folder}: cannot assign: nothing was changed")
    assert "logits/kernel: variable is float32[8, 5], value is float32[8, 3] (shapes differ)" in str(caught.value)


def test_a_preset_folder_lists_and_loads_with_its_weights_keys(presets):
    loaded = ws.load(presets["single"])
    with ws.open(presets["sharded"]) as sharded:
        assert sorted(loaded) == sorted(sharded.keys())


@pytest.fixture(scope="module")
def lora(presets, tmp_path_factory):
    """A LoRA file of rank 2 over the single-file preset's backbone, factors random."""
    backbone = keras_hub.models.Backbone.from_preset(presets["single"])
    backbone.enable_lora(2)
    rng = np.random.default_rng(2)
    for layer in backbone._flatten_layers(include_self=False):
        if getattr(layer, "lora_enabled", False):
            for factor in (layer.lora_kernel_a, layer.lora_kernel_b):
                factor.assign(rng.normal(size=factor.shape).astype("float32"))
    path = str(tmp_path_factory.mktemp("lora") / "adapter.lora.h5")
    backbone.save_lora_weights(path)
    return path, outputs(backbone)


def test_a_lora_file_assigns_its_factors_as_load_lora_weights_does(presets, lora):
    path, trained = lora
    expected = keras_hub.models.Backbone.from_preset(presets["single"])
    expected.load_lora_weights(path)
    target = keras_hub.models.Backbone.from_preset(presets["single"])
    target.enable_lora(2)
    report = tf2.assign(target, path)
    assert report.ok and not report.missing and not report.unexpected
    assert len(report.assigned) == 8 and all(key.rsplit("/", 1)[-1] in ("lora_kernel_a", "lora_kernel_b")
                                             for key in report.assigned)
    loaded = outputs(expected)
    for name, value in outputs(target).items():
        np.testing.assert_array_equal(value, loaded[name])
        np.testing.assert_array_equal(value, trained[name])


def test_a_lora_file_into_a_model_without_lora_or_of_another_rank_is_refused(lora):
    path, _ = lora
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(bert(), path)
    assert str(caught.value) == (f"{path}: holds LoRA factors of rank 2, and BertBackbone has no LoRA-enabled layer "
                                 "to take them: call its enable_lora(2) first (load_lora_weights does)")
    other = bert()
    other.enable_lora(4)
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(other, path)
    assert str(caught.value) == (f"{path}: holds LoRA factors of rank 2, and BertBackbone's LoRA is of rank 4: call "
                                 "its enable_lora(2) on a fresh instance")


def test_a_lora_file_without_its_rank_is_refused_naming_it(tmp_path):
    path = str(tmp_path / "odd.lora.h5")
    ws.save(path, {"lora/11/vars/lora_kernel_a": np.zeros((8, 2), "float32")})
    target = bert()
    target.enable_lora(2)
    with pytest.raises(ws.FormatError) as caught:
        tf2.assign(target, path)
    assert str(caught.value) == (f"{path}: holds no lora/vars/rank: not a LoRA file keras-hub's save_lora_weights "
                                 "wrote")
