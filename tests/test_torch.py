"""The PyTorch adapter: keys, buffers, plan-before-assign, dtypes, sources, and the examples."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import weightstore as ws  # noqa: E402
from weightstore.adapters import torch as torch_adapter  # noqa: E402
from weightstore.errors import AssignmentError, InvalidKeyError, SelectionError, UnsupportedDTypeError  # noqa: E402

nn = torch.nn
ROOT = Path(__file__).resolve().parent.parent


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = module.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_export_keys_are_state_dict_names_with_slashes_buffers_included():
    weights = torch_adapter.export(small_net())
    assert list(weights) == ["0/weight", "0/bias", "1/weight", "1/bias", "1/running_mean", "1/running_var",
                             "1/num_batches_tracked", "3/weight", "3/bias"]
    assert weights["0/weight"].shape == (4, 3, 3, 3) and weights["1/num_batches_tracked"].dtype == np.int64


def test_export_copies_and_selects():
    net = small_net()
    weights = torch_adapter.export(net)
    weights["3/bias"][:] = 42
    assert not torch.any(net[3].bias == 42)
    net[0].bias.requires_grad_(False)
    assert list(torch_adapter.export(net, trainable_only=True)) == ["0/weight", "1/weight", "1/bias", "3/weight",
                                                                    "3/bias"]
    assert list(torch_adapter.export(net, scope="1", include="running_*")) == ["running_mean", "running_var"]
    with pytest.raises(SelectionError, match="'4'"):
        torch_adapter.export(net, scope="4")


def test_trainable_only_with_also_keeps_batch_norm_statistics_on_export_and_assign():
    """Buffers are never trainable; ``also`` brings back the running statistics a model needs to infer."""
    net = small_net()
    assert list(torch_adapter.export(net, trainable_only=True, also="*/running_*")) == [
        "0/weight", "0/bias", "1/weight", "1/bias", "1/running_mean", "1/running_var", "3/weight", "3/bias"]
    trained = {key: np.full_like(value, 3) for key, value in torch_adapter.export(small_net()).items()}
    counter_before = net[1].num_batches_tracked.clone()
    report = torch_adapter.assign(net, trained, trainable_only=True, also="*/running_*", strict=False)
    assert torch.equal(net[1].running_var, torch.full((4,), 3.0)) and torch.equal(net[3].bias, torch.full((2,), 3.0))
    assert torch.equal(net[1].num_batches_tracked, counter_before)  # a buffer also= does not name
    assert "1/num_batches_tracked" not in report.assigned and "1/running_mean" in report.assigned
    with pytest.raises(AssignmentError, match="1/running_mean"):  # without also, a buffer in the file is unexpected
        torch_adapter.assign(small_net(), trained, trainable_only=True)


def test_assign_round_trip_in_place_keeps_the_very_same_parameters():
    """An optimizer holding the parameters keeps training the module (importing torch.optim costs 3 s)."""
    source, target = small_net(), nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    source[1].running_mean.normal_()
    parameters = list(target.parameters())
    running_mean = target[1].running_mean
    report = torch_adapter.assign(target, torch_adapter.export(source))
    assert report.ok and len(report.assigned) == 9
    assert_unchanged(target, state(source))
    assert all(a is b for a, b in zip(parameters, target.parameters(), strict=True))
    assert target[1].running_mean is running_mean and all(isinstance(p, nn.Parameter) for p in parameters)


def test_num_batches_tracked_is_never_missing_nor_unexpected():
    net = nn.BatchNorm1d(3)
    without = {k: v for k, v in torch_adapter.export(net).items() if k != "num_batches_tracked"}
    report = torch_adapter.assign(net, without)
    assert report.ok and "num_batches_tracked" not in report.assigned
    counted = {**without, "num_batches_tracked": np.array(7)}
    report = torch_adapter.assign(net, counted)
    assert "num_batches_tracked" in report.assigned and int(net.num_batches_tracked) == 7
    untracked = nn.BatchNorm1d(3, track_running_stats=False)  # no counter (nor statistics) to receive it
    report = torch_adapter.assign(untracked, {"weight": np.ones(3, np.float32), "bias": np.zeros(3, np.float32),
                                              "num_batches_tracked": np.array(7)})
    assert report.ok and sorted(report.assigned) == ["bias", "weight"]


def test_strict_failure_changes_nothing_and_lists_every_problem():
    net = small_net()
    before = state(net)
    weights = {k: v + 1 for k, v in torch_adapter.export(net).items()}
    del weights["0/bias"]
    weights["3/weight"] = np.ones((3, 4), np.float32)
    weights["3/wieght"] = np.ones((2, 4), np.float32)
    with pytest.raises(AssignmentError) as info:
        torch_adapter.assign(net, weights)
    message = str(info.value)
    assert "'0/bias'" in message and "3/weight: variable is float32[2, 4], value is float32[3, 4]" in message
    assert "no variable '3/wieght'; did you mean '3/weight'?" in message
    assert info.value.missing == ["0/bias"] and info.value.unexpected == ["3/wieght"]
    assert_unchanged(net, before)
    report = torch_adapter.assign(net, weights, strict=False)
    assert report.missing == ["0/bias"] and [m.key for m in report.mismatched] == ["3/weight"]
    assert torch.equal(net[0].weight, before["0.weight"] + 1) and torch.equal(net[3].weight, before["3.weight"])


def test_a_file_that_does_not_fit_is_the_errors_path(tmp_path):
    """Assigning a file: its refusals carry it as ``path`` (named once, at the head), a dict's do not."""
    net = small_net()
    before = state(net)
    weights = torch_adapter.export(net)
    path = tmp_path / "m.npz"
    ws.save(path, {**weights, "3/weight": np.ones((3, 4), np.float32)})
    with pytest.raises(AssignmentError) as info:
        torch_adapter.assign(net, path)
    assert info.value.path == str(path) and str(info.value).startswith(f"{path}: cannot assign: nothing was changed")
    with pytest.raises(SelectionError) as selected:
        torch_adapter.assign(net, path, include="3/wieght")
    assert selected.value.path == str(path)
    assert str(selected.value).startswith(f"{path}: include '3/wieght' matches no key; did you mean '3/weight'?")
    with pytest.raises(AssignmentError) as info:
        torch_adapter.assign(net, {**weights, "3/weight": np.ones((3, 4), np.float32)})
    assert info.value.path is None and str(info.value).startswith("cannot assign the weight dictionary: nothing")
    assert_unchanged(net, before)


def test_tied_parameters_must_get_one_value():
    net = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
    net[1].weight = net[0].weight  # one tensor, two keys
    before = state(net)
    tied = {"0/weight": np.ones((4, 2), np.float32), "1/weight": np.ones((4, 2), np.float32)}
    assert sorted(torch_adapter.assign(net, tied).assigned) == ["0/weight", "1/weight"]
    with pytest.raises(AssignmentError, match="1/weight.*the same tensor as '0/weight'"):
        torch_adapter.assign(net, {**tied, "1/weight": np.zeros((4, 2), np.float32)})
    assert torch.all(net[0].weight == 1) and before.keys() == state(net).keys()


def test_a_file_holding_one_of_tied_weights_assigns_both_as_torch_loads_it(tmp_path):
    """safetensors.torch.save_model and Hugging Face write a tied tensor once: the other key
    was reported missing, and a strict assign refused a file torch's own loader takes."""
    from safetensors.torch import load_model, save_model

    net = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
    net[1].weight = net[0].weight
    save_model(net, str(tmp_path / "tied.safetensors"))
    assert ws.open(tmp_path / "tied.safetensors").keys() == ["0/weight"]  # the alias left out
    expected = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
    expected[1].weight = expected[0].weight
    load_model(expected, str(tmp_path / "tied.safetensors"))
    for kept in ("0/weight", "1/weight"):  # whichever of the two a file holds
        ws.save(tmp_path / "one.npz", {kept: net[0].weight})
        fresh = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
        fresh[1].weight = fresh[0].weight
        for path in (tmp_path / "tied.safetensors", tmp_path / "one.npz"):
            report = torch_adapter.assign(fresh, path)
            assert report.ok and not report.missing
            tokens = torch.tensor([[0, 3]])
            assert torch.equal(fresh(tokens), expected(tokens))
    untied = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))  # two tensors: each needs its value
    with pytest.raises(AssignmentError, match="no value for variable '1/weight'"):
        torch_adapter.assign(untied, tmp_path / "tied.safetensors")


def test_dtype_that_does_not_widen_needs_cast():
    net = nn.Linear(2, 2)
    before = state(net)
    weights = {"weight": np.full((2, 2), 0.5), "bias": np.zeros(2, np.float16)}  # float64 into float32
    with pytest.raises(AssignmentError, match="weight: variable is float32.*pass cast=True"):
        torch_adapter.assign(net, weights)
    assert_unchanged(net, before)
    torch_adapter.assign(net, weights, cast=True)
    assert net.weight.dtype == torch.float32 and torch.all(net.weight == 0.5)
    torch_adapter.assign(net, {"weight": np.ones((2, 2), np.float16), "bias": np.ones(2, np.float16)})  # widens
    assert torch.all(net.bias == 1)


def test_integers_into_float8_need_cast_and_into_bfloat16_only_when_too_wide(tmp_path):
    """float8_e4m3fn holds 3 mantissa bits: an int8 17 became 16 without cast=True (numpy calls
    int8 -> any float "safe"); bfloat16's 8 bits hold every int8, not every int16."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.zeros(4, dtype=torch.float8_e4m3fn))
            self.register_buffer("offset", torch.zeros(4, dtype=torch.bfloat16))

    net = Scaled()
    before = state(net)
    ws.save(tmp_path / "int8.safetensors", {"scale": np.array([17, 100, -127, 9], np.int8),
                                            "offset": np.array([127, -128, 3, 0], np.int8)})
    with pytest.raises(AssignmentError, match="scale: variable is float8_e4m3fn.*pass cast=True"):
        torch_adapter.assign(net, tmp_path / "int8.safetensors")
    assert_unchanged(net, before)
    with pytest.raises(AssignmentError, match="scale: variable is float8_e4m3fn"):
        torch_adapter.assign(net, {"scale": np.ones(4, np.float16), "offset": np.ones(4, np.int8)})
    with pytest.raises(AssignmentError, match="offset: variable is bfloat16"):
        torch_adapter.assign(net, {"scale": np.ones(4, ml_dtypes.float8_e4m3fn), "offset": np.full(4, 257, np.int16)})
    assert_unchanged(net, before)
    torch_adapter.assign(net, {"scale": np.ones(4, ml_dtypes.float8_e4m3fn), "offset": np.array([127, -128, 3, 0], np.int8)})
    assert net.offset.tolist() == [127, -128, 3, 0]
    torch_adapter.assign(net, tmp_path / "int8.safetensors", cast=True)  # rounding, asked for
    assert net.scale.float().tolist() == [16, 96, -128, 9]


def test_cast_refuses_a_value_out_of_the_parameters_range(tmp_path):
    net = nn.Linear(2, 2).to(torch.float16)
    before = state(net)
    ws.save(tmp_path / "w.npz", {"weight": np.full((2, 2), 70000.0, np.float32), "bias": np.zeros(2, np.float32)})
    with pytest.raises(AssignmentError, match="'weight'.*70000, beyond float16's range"):
        torch_adapter.assign(net, tmp_path / "w.npz", cast=True)
    assert_unchanged(net, before)
    net = nn.Linear(2, 2).to(torch.float8_e4m3fn)  # no inf: a cast makes one NaN
    before = state(net)
    with pytest.raises(AssignmentError, match="'weight'.*holds inf, which float8_e4m3fn cannot hold"):
        torch_adapter.assign(net, {"weight": np.full((2, 2), np.inf, np.float32), "bias": np.zeros(2)}, cast=True)
    assert_unchanged(net, before)


def test_strided_and_reversed_arrays_are_assigned_as_they_read():
    net = nn.Linear(3, 2)
    weight = np.arange(6, dtype=np.float32).reshape(3, 2)
    torch_adapter.assign(net, {"weight": weight.T, "bias": np.arange(2, dtype=np.float32)[::-1]})
    assert net.weight.tolist() == weight.T.tolist() and net.bias.tolist() == [1.0, 0.0]


def test_bfloat16_round_trips_through_a_store(tmp_path):
    net = nn.Linear(3, 2).to(torch.bfloat16)
    weights = torch_adapter.export(net)
    assert weights["weight"].dtype == ml_dtypes.bfloat16
    ws.save(tmp_path / "bf16.npz", weights)
    fresh = nn.Linear(3, 2).to(torch.bfloat16)
    torch_adapter.assign(fresh, tmp_path / "bf16.npz")
    assert torch.equal(fresh.weight, net.weight)


@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"])
def test_every_float8_torch_and_ml_dtypes_share_round_trips(tmp_path, name):
    """These were refused as having no numpy counterpart, though ml_dtypes has each (MX scales
    saved by safetensors.torch loaded, but went into no module)."""
    from safetensors.torch import save_file

    dtype = getattr(torch, name)

    class Scales(nn.Module):
        def __init__(self, values):
            super().__init__()
            self.register_buffer("scale", torch.tensor(values).to(dtype))

    source = Scales([0.25, 1.0, 2.0, 64.0])
    weights = torch_adapter.export(source)
    assert weights["scale"].dtype == getattr(ml_dtypes, name) and weights["scale"].tolist() == [0.25, 1.0, 2.0, 64.0]
    ws.save(tmp_path / "ws.safetensors", weights)
    save_file(source.state_dict(), str(tmp_path / "torch.safetensors"))
    for path in (tmp_path / "ws.safetensors", tmp_path / "torch.safetensors"):
        target = Scales([1.0] * 4)
        assert torch_adapter.assign(target, path).ok
        assert target.scale.dtype == dtype and torch.equal(target.scale.view(torch.uint8), source.scale.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_dict_or_parameters_passed_as_they_are_save_and_assign(tmp_path, dtype):
    """np.asarray refuses a tensor that requires grad and has no bfloat16: a state_dict() or
    named_parameters() passed straight in leaked torch's own TypeError and RuntimeError."""
    net = small_net().to(dtype)
    for given in (net.state_dict(), dict(net.named_parameters())):
        ws.save(tmp_path / "m.safetensors", given)
        loaded = ws.load(tmp_path / "m.safetensors")  # stored under the names, read as keys
        assert list(loaded) == [name.replace(".", "/") for name in given]
        fresh = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2)).to(dtype)
        assert torch_adapter.assign(fresh, given, strict=False).assigned
        for key, value in given.items():
            assert torch.equal(fresh.state_dict()[key], value), key
    with torch.device("meta"):
        hollow = nn.Linear(2, 2)
    with pytest.raises(SelectionError, match=r"m\.npz: tensor 'weight': is on the meta device and holds no values"):
        ws.save(tmp_path / "m.npz", hollow.state_dict())
    assert not (tmp_path / "m.npz").exists()


def test_conjugate_and_negative_views_are_saved_as_their_values_and_sparse_tensors_refused(tmp_path):
    """numpy() refuses a view with torch's conjugate or negative bit set, and a sparse or nested
    tensor is no dense array: each leaked torch's own error, naming no tensor."""
    values = torch.tensor([1 + 2j, 3 - 4j])
    given = {"conjugate": values.conj(), "negative": torch._neg_view(torch.tensor([1.5, -2.0]))}
    ws.save(tmp_path / "views.npz", given)
    loaded = ws.load(tmp_path / "views.npz")
    assert loaded["conjugate"].tolist() == [1 - 2j, 3 + 4j] and loaded["negative"].tolist() == [-1.5, 2.0]
    for key, tensor, fix in (("sparse", torch.eye(2).to_sparse(), "to_dense"),
                             ("nested", torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "unbind")):
        with pytest.raises(UnsupportedDTypeError, match=rf"tensor '{key}': .*{fix}"):
            ws.save(tmp_path / "w.npz", {key: tensor})
    assert not (tmp_path / "w.npz").exists()
    with pytest.raises(UnsupportedDTypeError, match="tensor 'w': torch dtype torch.complex32") as caught:
        ws.save(tmp_path / "w.npz", {"w": torch.zeros(2, dtype=torch.complex32)})
    assert caught.value.key == "w"


def test_saving_a_state_dict_holds_no_copy_of_it(tmp_path):
    """Converted one tensor at a time, and a CPU tensor's array shares its memory: saving 256 MB
    of tensors raises the process's peak by far less than another 256 MB."""
    code = (
        "import resource, sys, torch, weightstore as ws\n"
        "weights = {f'layer_{i}/w': torch.ones(1 << 22, requires_grad=True) for i in range(16)}\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "ws.save(sys.argv[1], weights)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.npz")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < 96, done.stdout  # MB above the peak before the save
    assert ws.load(tmp_path / "m.npz")["layer_3/w"].sum() == 1 << 22


def test_assign_takes_a_path_a_store_and_a_version_and_skips_unchanged_versions(tmp_path):
    source, target = small_net(), nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    ws.save(tmp_path / "m.h5", torch_adapter.export(source), digests=True)  # remembered as a version's are
    assert torch_adapter.assign(target, tmp_path / "m.h5").ok
    with ws.open(tmp_path / "m.h5") as store:
        assert len(torch_adapter.assign(target, store).assigned) == 9
    version = ws.publish(tmp_path / "versions", torch_adapter.export(source), step=1)
    assert len(torch_adapter.assign(target, version).skipped) == 9  # the very bytes the file gave
    with torch.no_grad():
        source[3].bias.add_(1)
    newer = ws.publish(tmp_path / "versions", torch_adapter.export(source), step=2)
    report = torch_adapter.assign(target, newer)
    assert report.assigned == ["3/bias"] and len(report.skipped) == 8
    assert_unchanged(target, state(source))


def test_scope_and_mapping_place_one_model_inside_another():
    ensemble = nn.ModuleDict({"model_1": nn.Linear(2, 2), "model_10": nn.Linear(2, 2)})
    weights = {"w": np.eye(2, dtype=np.float32), "b": np.ones(2, np.float32)}
    before = state(ensemble)
    report = torch_adapter.assign(ensemble, weights, scope="model_1", mapping={"w": "weight", "b": "bias"})
    assert report.assigned == ["model_1/weight", "model_1/bias"]
    assert torch.equal(ensemble["model_1"].weight, torch.eye(2))
    assert torch.equal(ensemble["model_10"].weight, before["model_10.weight"])  # whole segments only


@pytest.mark.parametrize("bad", [{"w": np.ones(2)}, {"a//b": np.ones(2)}])
def test_bad_input_names_the_key(bad):
    with pytest.raises((AssignmentError, InvalidKeyError)) as info:
        torch_adapter.assign(nn.Linear(2, 2), bad)
    assert next(iter(bad)) in str(info.value)


def test_a_module_without_data_is_refused_not_silently_skipped():
    with torch.device("meta"):
        net = nn.Linear(2, 2)
    with pytest.raises(AssignmentError, match="meta device.*'weight'.*to_empty"):
        torch_adapter.assign(net, {"weight": np.ones((2, 2), np.float32), "bias": np.ones(2, np.float32)})
    with pytest.raises(SelectionError, match="tensor 'weight': is on the meta device") as caught:
        torch_adapter.export(net)
    assert (caught.value.path, caught.value.key) == (None, "weight")


def test_a_lazy_module_before_its_first_forward_pass_is_refused_saying_so(tmp_path):
    """Lazy modules' parameters have no shape until a forward pass: torch's own ValueError and
    RuntimeError leaked from export and assign."""
    net = nn.Sequential(nn.LazyLinear(3))
    weights = {"0/weight": np.ones((3, 4), np.float32), "0/bias": np.ones(3, np.float32)}
    with pytest.raises(AssignmentError, match="lazy module.*'0/weight'.*forward pass") as caught:
        torch_adapter.assign(net, weights)
    assert caught.value.missing == ["0/weight", "0/bias"]
    with pytest.raises(SelectionError, match="tensor '0/weight': .*lazy.*forward pass"):
        torch_adapter.export(net)
    with pytest.raises(SelectionError, match="tensor '0/weight': .*lazy.*forward pass"):
        torch_adapter.export_pieces(net, rank=0, world=1)
    net(torch.ones(2, 4))
    assert torch_adapter.assign(net, weights).ok
    assert torch.equal(net[0].weight, torch.ones(3, 4))


class WithExtraState(nn.Module):
    """Keeps state beside its weights as PyTorch allows (TransformerEngine's fp8 metadata):
    state_dict() holds get_extra_state()'s object under '_extra_state'."""

    def __init__(self, extra):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.extra = extra

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


@pytest.mark.parametrize("extra", [{"fp8_meta_version": 3}, torch.arange(3, dtype=torch.uint8)])
def test_extra_state_is_no_weight_and_is_left_out_of_export_and_assign(tmp_path, extra):
    """export and assign ended in a bare AttributeError ('dict' object has no attribute 'dtype'),
    with exclude= too; and a tensor there is a copy set_extra_state alone takes, no weight."""
    source = WithExtraState(extra)
    assert "_extra_state" in source.state_dict()
    weights = torch_adapter.export(source)
    assert list(weights) == ["lin/weight", "lin/bias"]
    ws.save(tmp_path / "m.safetensors", weights)
    target = WithExtraState(extra)
    report = torch_adapter.assign(target, tmp_path / "m.safetensors")
    assert report.ok and report.assigned == ["lin/weight", "lin/bias"] and not report.missing
    assert torch.equal(target.lin.weight, source.lin.weight)
    assert torch_adapter.assign(target, weights, exclude="_extra_state").ok


def test_a_buffer_named_extra_state_by_a_module_without_that_method_is_a_weight():
    module = nn.Module()
    module.register_buffer("_extra_state", torch.arange(3.0))
    assert list(torch_adapter.export(module)) == ["_extra_state"]


def test_a_dynamically_quantized_module_is_refused_not_exported_without_its_weights(tmp_path):
    """quantize_dynamic's state_dict holds a torch.dtype and a tuple of packed tensors, the
    weights themselves: export ended in "'torch.dtype' object has no attribute 'dtype'", and
    leaving them out would write a file of scales alone."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated
        quantized = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(4, 3)), {nn.Linear},
                                                           dtype=torch.qint8)
    assert "0._packed_params.dtype" in quantized.state_dict()
    ws.save(tmp_path / "w.npz", {"0/scale": np.ones(()), "0/zero_point": np.zeros((), np.int64)})
    for attempt in (lambda: torch_adapter.export(quantized), lambda: torch_adapter.assign(quantized, tmp_path / "w.npz")):
        with pytest.raises(ws.UnsupportedDTypeError, match="'0._packed_params.dtype'.*before quantizing"):
            attempt()


def test_not_a_module_is_refused():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        torch_adapter.export({"weight": torch.zeros(2)})


class _Ensemble(nn.Module):
    """Three members in a ModuleList, so ``state_dict`` names them ``members.0.``, ``members.1.``…"""

    def __init__(self) -> None:
        super().__init__()
        self.members = nn.ModuleList([small_net() for _ in range(3)])


def test_a_member_scope_written_with_torch_dots_is_refused_pointing_at_its_key(tmp_path):
    """``scope="members.1"`` (torch's spelling) names no variable; the refusal offers
    ``members/1``, the scope that pairs, not the bare ``members`` above it."""
    ensemble = _Ensemble()
    before = state(ensemble)
    path = tmp_path / "member.safetensors"
    ws.save(path, torch_adapter.export(small_net()))
    with pytest.raises(AssignmentError) as info:
        torch_adapter.assign(ensemble, path, scope="members.1")
    assert info.value.path == str(path)
    assert "no variable is under scope 'members.1'; did you mean 'members/1'?" in str(info.value)
    with pytest.raises(AssignmentError, match=r"scope 'members\.1\.'; did you mean 'members/1'\?"):
        torch_adapter.assign(ensemble, path, scope="members.1.")  # a state_dict prefix, as torch strips one
    assert_unchanged(ensemble, before)
    torch_adapter.assign(ensemble, path, scope="members/1")


def test_a_file_object_given_to_assign_is_told_to_pass_a_name(tmp_path):
    """``torch.assign(net, open(f, "rb"))`` said weights must be a dict, a path, a Store or a
    Version, not BufferedReader; it says, as ``ws.load`` does, that files go by name, and which."""
    net = torch.nn.Linear(3, 2)
    path = tmp_path / "net.safetensors"
    ws.save(path, net.state_dict())
    with open(path, "rb") as handle:
        with pytest.raises(TypeError, match=rf"not a file object \(BufferedReader\).*; pass its name instead: "
                                            rf"{re.escape(repr(str(path)))}$"):
            torch_adapter.assign(net, handle)
        assert torch_adapter.assign(net, handle.name).assigned
    with pytest.raises(ws.NotAPathError, match=r"not a file object \(BytesIO\).*; write its bytes to a file"):
        torch_adapter.assign(net, io.BytesIO(path.read_bytes()))


def test_a_member_scope_into_a_file_of_torch_names_says_how_to_read_them(tmp_path):
    """``ws.save`` of ``export(names="torch")`` keeps ``members.1.0.weight`` as the key, so
    ``scope="members/1"`` matches nothing: the refusal (Python and ``ws``) says the keys are
    torch names and how to select them (from ``ws`` too, which reads no ``names``), not a far-off
    ``did you mean 'members.2.1.bias'``."""
    ensemble = _Ensemble()
    path = tmp_path / "ensemble.safetensors"
    ws.save(path, torch_adapter.export(ensemble, names="torch"))
    with pytest.raises(SelectionError) as info:
        ws.load(path, scope="members/1")
    message = str(info.value)
    assert message.startswith(f"{path}: scope 'members/1' matches no key; its keys are PyTorch state_dict names")
    assert "names='torch'" in message and "include='members.1.*'" in message
    assert ws.load(path, scope="members/1", names="torch").keys() == torch_adapter.export(ensemble.members[1]).keys()
    with pytest.raises(SelectionError) as info:  # torch's spelling: read so, the scope joins with '/'
        ws.load(path, scope="members.1")
    assert "names='torch' (ws.load, ws.open) and scope 'members/1'" in str(info.value)
    done = subprocess.run([sys.executable, "-m", "weightstore", "ls", str(path), "--scope", "members/1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "its keys are PyTorch state_dict names" in done.stderr
    assert "--include 'members.1.*'" in done.stderr  # what ws itself can do: it reads no names='torch'
    listed = subprocess.run([sys.executable, "-m", "weightstore", "ls", str(path), "--include", "members.1.*", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert {row["key"] for row in json.loads(listed.stdout)["tensors"]} == \
        {f"members.1.{key.replace('/', '.')}" for key in torch_adapter.export(ensemble.members[1])}


def test_example_keras_to_torch_gives_the_same_predictions_both_ways(tmp_path, capsys):
    pytest.importorskip("keras")
    from examples import keras_to_torch

    result = keras_to_torch.main(str(tmp_path))
    assert result["to_torch"] < 1e-5 and result["back_to_keras"] < 1e-5
    assert "dw/weight" in result["assigned"] and "bn2/running_var" in result["assigned"]
    assert "Keras -> PyTorch: 14 tensors assigned, max abs difference" in capsys.readouterr().out


def test_example_tf1_to_torch_serves_without_tensorflow(tmp_path):
    """Trained here; served in a process that blocks TensorFlow, so reading the checkpoint must not need it."""
    pytest.importorskip("tensorflow")
    from examples import tf1_to_torch

    tf1_to_torch.train_and_save(tmp_path)
    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "from pathlib import Path\n"
            "from examples import tf1_to_torch\n"
            f"result = tf1_to_torch.serve(Path({str(tmp_path)!r}))\n"
            "assert result['difference'] < 1e-5 and not result['tensorflow_loaded'], result\n")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TensorFlow imported in this process: False" in done.stdout


@pytest.mark.slow  # torch.compile and DDP in a process of their own
def test_a_compiled_or_ddp_wrapped_module_has_its_models_keys_in_a_version_both_ways(tmp_path):
    """torch.compile's wrapper names every tensor '_orig_mod.…' and DDP's 'module.…': a trainer
    publishing its compiled or DDP module put those prefixes in every key, so a plain module (or a
    Keras model with layout="torch") following it was refused, and the reverse. The adapter reads
    the model inside the wrapper, as a user saving model.state_dict() before wrapping does.

    In a process of its own, without TensorFlow: torch.compile imports Triton (PyPI's CUDA
    build of torch brings it), whose libraries crash a process that loaded theirs."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path

        import torch
        import torch.distributed as dist
        from torch import nn

        import weightstore as ws
        from weightstore.adapters import torch as torch_adapter
        from weightstore.adapters.serving.follower import Follower

        assert "tensorflow" not in sys.modules and "jax" not in sys.modules
        folder = Path({str(tmp_path)!r})

        def shifted(by):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
            with torch.no_grad():
                for tensor in net.state_dict().values():
                    tensor.add_(by if tensor.is_floating_point() else int(by))
            return net

        def equal(wrapped, plain):  # state_dict names differ by the wrapper's prefix
            pairs = zip(wrapped.state_dict().values(), plain.state_dict().values(), strict=True)
            return all(torch.equal(a, b) for a, b in pairs)

        plain = shifted(0)
        compiled = torch.compile(shifted(1.0))
        dist.init_process_group("gloo", init_method=f"file://{{folder / 'rendezvous'}}", rank=0, world_size=1)
        try:
            ddp = torch.nn.parallel.DistributedDataParallel(torch.compile(shifted(2.0)))
            assert torch_adapter.export(compiled).keys() == torch_adapter.export(ddp).keys() == \
                torch_adapter.export(plain).keys()
            ws.publish(folder / "run", torch_adapter.export(plain), step=1)
            for wrapped in (compiled, ddp):
                with Follower(wrapped, folder / "run", poll=0.05) as follower:
                    assert follower.wait(step=1, timeout=30).step == 1
                assert equal(wrapped, plain)
            torch_adapter.assign(ddp, torch_adapter.export(shifted(3.0)))
            ws.publish(folder / "run", torch_adapter.export(ddp), step=3)  # from the wrapped trainer
            report = torch_adapter.assign(plain, ws.latest(folder / "run"))
            assert len(report.assigned) == len(plain.state_dict())
            assert equal(ddp, plain)
        finally:
            dist.destroy_process_group()
        print("wrappers read as their model")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrappers read as their model" in done.stdout


@pytest.mark.parametrize("prefix", ["_orig_mod.", "module.", "module._orig_mod.", "_orig_mod/"])
def test_a_file_saved_from_a_wrappers_own_state_dict_assigns_into_the_model(tmp_path, prefix):
    """compiled.state_dict() names '_orig_mod.fc.weight', a DDP module's 'module.fc.weight' (and
    weightstore wrote '_orig_mod/…' from a compiled module before it read wrappers as their
    model): such a file assigns into the plain model, since every key carries the wrapper and the
    model has no such name; a model that does have a top-level 'module' keeps its own key."""
    from safetensors.torch import save_file

    source, target = small_net(), small_net()
    with torch.no_grad():
        for tensor in source.state_dict().values():
            tensor.add_(1)
    path = tmp_path / "wrapped.safetensors"
    spelled = (lambda name: name.replace(".", "/")) if prefix.endswith("/") else (lambda name: name)
    save_file({prefix + spelled(name): tensor.contiguous() for name, tensor in source.state_dict().items()}, str(path))
    report = torch_adapter.assign(target, path)
    assert len(report.assigned) == len(target.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True))

    holder = nn.Module()
    holder.module = small_net()  # a model whose own top-level name is 'module': nothing is taken off
    own = {"module." + name: tensor + 2 for name, tensor in source.state_dict().items()}
    save_file({name: tensor.contiguous() for name, tensor in own.items()}, str(tmp_path / "own.safetensors"))
    torch_adapter.assign(holder, tmp_path / "own.safetensors")
    assert all(torch.equal(own[name], tensor) for name, tensor in holder.state_dict().items())
    # DDP around that model names 'module.module.…': one wrapper's name comes off, not the model's own
    twice = {"module." + name: tensor + 3 for name, tensor in own.items()}
    save_file({name: tensor.contiguous() for name, tensor in twice.items()}, str(tmp_path / "twice.safetensors"))
    torch_adapter.assign(holder, tmp_path / "twice.safetensors")
    assert all(torch.equal(twice["module." + name], tensor) for name, tensor in holder.state_dict().items())


def test_wrappers_files_imported_by_scope_into_an_ensembles_store_assign_into_the_ensemble(tmp_path):
    """The ensembles job from the shell with DDP and compiled trainers' files: ``ws import
    ddp.safetensors --into ensemble.safetensors --scope members/0`` keeps the wrapper's name after
    the scope (``members/0/module/0/weight``), which the assign took off only at the front, so the
    ensemble and its store "looked like different architectures"."""
    from safetensors.torch import save_file

    sources = [small_net() for _ in range(2)]
    for i, (source, prefix) in enumerate(zip(sources, ("module.", "_orig_mod."), strict=True)):
        with torch.no_grad():
            for tensor in source.state_dict().values():
                tensor.add_(i + 1)
        save_file({prefix + name: tensor.contiguous() for name, tensor in source.state_dict().items()},
                  str(tmp_path / f"wrapped{i}.safetensors"))
        done = subprocess.run([sys.executable, "-m", "weightstore", "import", tmp_path / f"wrapped{i}.safetensors",
                               "--into", tmp_path / "ensemble.safetensors", "--scope", f"members/{i}"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    assert "members/0/module/0/weight" in ws.load(tmp_path / "ensemble.safetensors")
    ensemble = nn.Module()
    ensemble.members = nn.ModuleList([small_net(), small_net()])
    report = torch_adapter.assign(ensemble, tmp_path / "ensemble.safetensors")
    assert len(report.assigned) == len(ensemble.state_dict())
    for member, source in zip(ensemble.members, sources, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(member.state_dict().values(), source.state_dict().values(),
                                                     strict=True))


def test_a_mapping_of_the_wrappers_name_still_decides_what_the_names_mean():
    """mapping={'module': ''} (what an older refusal told a DDP user to pass) keeps working: the
    user's own rule is applied, no wrapper's name is taken off before it."""
    source, target = small_net(), small_net()
    values = {"module." + name: tensor.numpy() + 1 for name, tensor in source.state_dict().items()}
    torch_adapter.assign(target, values, mapping={"module": ""})
    assert all(np.array_equal(values["module." + name], tensor.numpy()) for name, tensor in target.state_dict().items())
    # a rule about the model's own names leaves the wrapper's name to be taken off as without one
    renamed = nn.Sequential()
    for name, layer in zip(("first", "1", "2", "3"), small_net(), strict=True):
        renamed.add_module(name, layer)
    torch_adapter.assign(renamed, values, mapping={"0": "first"})
    assert np.array_equal(values["module.0.weight"], renamed.first.weight.detach().numpy())


def test_a_mapping_of_a_wrappers_name_after_a_scope_still_decides_what_the_names_mean(tmp_path):
    """The way to pair a store of wrappers' files under scopes before the assign took the
    wrapper's name out itself: a mapping from ``members/0/module``. The assign took the name out
    first, so the user's rule matched no key and the assign was refused; the rule is applied."""
    sources = [small_net() for _ in range(2)]
    values = {f"members/{i}/{wrapper}/{name.replace('.', '/')}": tensor.numpy() + i + 1 for i, (source, wrapper)
              in enumerate(zip(sources, ("module", "_orig_mod"), strict=True))
              for name, tensor in source.state_dict().items()}
    ws.save(tmp_path / "ensemble.safetensors", values)
    ensemble = nn.Module()
    ensemble.members = nn.ModuleList([small_net(), small_net()])
    report = torch_adapter.assign(ensemble, tmp_path / "ensemble.safetensors",
                                  mapping={"members/0/module": "members/0", "members/1/_orig_mod": "members/1"})
    assert len(report.assigned) == len(ensemble.state_dict())
    for i, member in enumerate(ensemble.members):
        wrapper = ("module", "_orig_mod")[i]
        assert all(np.array_equal(tensor.numpy(), values[f"members/{i}/{wrapper}/{name.replace('.', '/')}"])
                   for name, tensor in member.state_dict().items())


def test_another_architectures_file_is_not_called_an_ensemble_of_the_model(tmp_path):
    """A transformer's file given to a small MLP by mistake: each of its layers' ``attn`` and
    ``mlp`` holds two weights and two biases, as the MLP does, and the refusal called the file
    an ensemble of the MLP and said to assign ``ws.load(path, scope='layers/0/attn')``, which pairs
    nothing either. A scope is a member where its keys are the model's, not merely its leaves."""
    values = {f"layers/{i}/{block}/{layer}/{leaf}": np.ones((8, 8) if leaf == "weight" else 8, np.float32)
              for i in range(4) for block, layers in (("attn", ("qkv", "proj")), ("mlp", ("fc1", "fc2")))
              for layer in layers for leaf in ("weight", "bias")}
    ws.save(tmp_path / "transformer.npz", values)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(AssignmentError, match="look like different architectures") as caught:
        torch_adapter.assign(mlp, tmp_path / "transformer.npz")
    assert "ensemble" not in str(caught.value)


def test_a_leading_one_on_one_tensor_is_not_called_a_stacked_ensemble():
    """A ViT's position embedding (1, 5, 4) given a (5, 4) value is one mismatch, not a vmap-ed
    ensemble of 1 member: the refusal gives no stacking advice."""
    module = nn.Module()
    module.pos_embed = nn.Parameter(torch.zeros(1, 5, 4))
    module.head = nn.Linear(4, 2)
    values = {"pos_embed": np.ones((5, 4), np.float32), **{f"head/{name}": tensor.detach().numpy()
                                                         for name, tensor in module.head.named_parameters()}}
    with pytest.raises(ws.AssignmentError, match="pos_embed") as caught:
        torch_adapter.assign(module, values)
    assert "stacked" not in str(caught.value)
