"""The Flax adapter: NNX modules in place, parameter pytrees as new trees, and the example."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

from flax.core import FrozenDict  # noqa: E402

import weightstore as ws  # noqa: E402
from weightstore.adapters import flax as flax_adapter  # noqa: E402
from weightstore.adapters.plan import AssignWarning  # noqa: E402
from weightstore.errors import AssignmentError, LayoutError, SelectionError  # noqa: E402

ZEROS = nnx.initializers.zeros_init()  # random initializers compile once per shape: seconds each


class Net(nnx.Module):
    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.conv = nnx.Conv(2, 3, (3, 3), kernel_init=ZEROS, rngs=rngs)
        self.bn = nnx.BatchNorm(3, use_running_average=True, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(3, 2, kernel_init=ZEROS, rngs=rngs)])
        self.dropout = nnx.Dropout(0.5, rngs=rngs)  # RNG state: not weights


def random_weights(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {key: rng.normal(size=value.shape).astype(value.dtype) for key, value in flax_adapter.export(Net()).items()}


def test_export_keys_are_state_paths_params_and_batch_stats_not_rng_state():
    weights = flax_adapter.export(Net())
    assert sorted(weights) == ["bn/bias", "bn/mean", "bn/scale", "bn/var", "conv/bias", "conv/kernel",
                               "layers/0/bias", "layers/0/kernel"]
    assert sorted(flax_adapter.export(Net(), trainable_only=True)) == ["bn/bias", "bn/scale", "conv/bias",
                                                                       "conv/kernel", "layers/0/bias",
                                                                       "layers/0/kernel"]
    assert isinstance(weights["conv/kernel"], np.ndarray) and weights["conv/kernel"].flags.writeable
    with pytest.raises(SelectionError, match="'head'"):
        flax_adapter.export(Net(), scope="head")


def test_trainable_only_with_also_keeps_batch_stats_on_export_and_assign():
    """``nnx.Param`` is trainable, ``BatchStat`` is not; ``also`` brings the statistics back."""
    assert sorted(flax_adapter.export(Net(), trainable_only=True, also="bn/mean")) == [
        "bn/bias", "bn/mean", "bn/scale", "conv/bias", "conv/kernel", "layers/0/bias", "layers/0/kernel"]
    weights = random_weights()
    net = Net()
    var_before = np.array(net.bn.var.get_value())
    report = flax_adapter.assign(net, {k: v for k, v in weights.items() if k != "bn/var"}, trainable_only=True,
                                 also="bn/mean")
    assert report.ok and sorted(report.assigned) == sorted(set(weights) - {"bn/var"})
    np.testing.assert_array_equal(np.asarray(net.bn.mean.get_value()), weights["bn/mean"])
    np.testing.assert_array_equal(np.asarray(net.bn.var.get_value()), var_before)
    with pytest.raises(AssignmentError, match="bn/mean"):  # without also, a statistic in the dict is unexpected
        flax_adapter.assign(Net(), {k: v for k, v in weights.items() if k != "bn/var"}, trainable_only=True)


def test_a_linen_variables_dict_trains_its_params_and_restores_batch_stats_only_when_asked(tmp_path):
    """In Linen's ``{"params": …, "batch_stats": …}`` every leaf counted as trainable, so
    ``trainable_only=True`` saved the statistics too, and ``restore`` took no ``trainable_only``:
    a selective file went back only with ``strict=False``. ``params`` is what trains; ``also``
    adds the statistics, and a restore so selected keeps the other leaves (predictions equal
    to Linen's own ``apply`` of the expected variables). A strict restore of the params alone
    says that the file holds no statistics, and the ``also=`` that adds them."""
    import flax.linen as linen

    class Model(linen.Module):
        @linen.compact
        def __call__(self, x, train=False):
            x = linen.BatchNorm(use_running_average=not train)(linen.Dense(8)(x))
            return linen.Dense(1)(linen.relu(x))

    model, x = Model(), np.random.default_rng(0).standard_normal((16, 4)).astype("float32")

    def trained(seed):
        variables = model.init(jax.random.PRNGKey(seed), x)
        _, moved = model.apply(variables, x, train=True, mutable=["batch_stats"])
        return {"params": variables["params"], "batch_stats": moved["batch_stats"]}

    source, target = trained(0), trained(1)
    trainable = flax_adapter.export(source, trainable_only=True)
    assert trainable and all(key.startswith("params/") for key in trainable)
    ws.save(tmp_path / "params.npz", trainable)
    with pytest.raises(AssignmentError) as strict:  # a plain restore: says what the file lacks and how to add it
        flax_adapter.restore(target, tmp_path / "params.npz")
    assert "the file holds none of the model's non-trainable variables" in str(strict.value)
    assert "include them on export with trainable_only=True, also='batch_stats/*'" in str(strict.value)
    restored = flax_adapter.restore(target, tmp_path / "params.npz", trainable_only=True)
    expected = model.apply({"params": source["params"], "batch_stats": target["batch_stats"]}, x)
    np.testing.assert_array_equal(model.apply(restored, x), expected)
    ws.save(tmp_path / "both.npz", flax_adapter.export(source, trainable_only=True, also="batch_stats/*"))
    restored = flax_adapter.restore(target, tmp_path / "both.npz", trainable_only=True, also="batch_stats/*")
    np.testing.assert_array_equal(model.apply(restored, x), model.apply(source, x))
    bare = flax_adapter.export(source["params"], trainable_only=True)  # a bare params tree: every leaf
    assert sorted(f"params/{key}" for key in bare) == sorted(trainable)


def test_assign_in_place_through_a_store(tmp_path):
    weights = random_weights()
    ws.save(tmp_path / "w.npz", weights)
    net = Net()
    report = flax_adapter.assign(net, tmp_path / "w.npz")
    assert report.ok and len(report.assigned) == 8
    exported = flax_adapter.export(net)
    for key, value in weights.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    assert isinstance(net.conv.kernel.get_value(), jax.Array)


def test_strict_failure_changes_nothing():
    net = Net()
    before = flax_adapter.export(net)
    weights = random_weights()
    weights["bn/mean"] = np.ones(4, np.float32)
    del weights["conv/bias"]
    with pytest.raises(AssignmentError) as info:
        flax_adapter.assign(net, weights)
    message = str(info.value)
    assert "bn/mean: variable is float32[3], value is float32[4]" in message and "'conv/bias'" in message
    after = flax_adapter.export(net)
    assert all(np.array_equal(after[key], value) for key, value in before.items())


def test_dtype_that_does_not_widen_needs_cast():
    net = Net()
    weights = {key: value.astype(np.float64) for key, value in random_weights().items()}
    with pytest.raises(AssignmentError, match="pass cast=True"):
        flax_adapter.assign(net, weights)
    flax_adapter.assign(net, weights, cast=True)
    assert net.conv.kernel.get_value().dtype == np.float32


def test_versions_skip_unchanged_tensors(tmp_path):
    net = Net()
    weights = random_weights()
    first = ws.publish(tmp_path / "v", weights, step=1)
    assert len(flax_adapter.assign(net, first).assigned) == 8
    second = ws.publish(tmp_path / "v", {**weights, "bn/mean": weights["bn/mean"] + 1}, step=2)
    report = flax_adapter.assign(net, second)
    assert report.assigned == ["bn/mean"] and len(report.skipped) == 7


def linen_tree():
    return {"params": {"Dense_0": {"kernel": jax.numpy.zeros((3, 2)), "bias": np.zeros(2, np.float32)},
                       "BatchNorm_0": {"scale": jax.numpy.ones(2), "bias": jax.numpy.zeros(2)}},
            "batch_stats": {"BatchNorm_0": {"mean": jax.numpy.zeros(2), "var": jax.numpy.ones(2)}},
            "config": "not an array"}


def test_restore_returns_a_new_tree_and_never_touches_the_old_one():
    tree = FrozenDict(linen_tree())
    weights = {key: np.full(value.shape, 7, np.float32) for key, value in flax_adapter.export(tree).items()}
    assert sorted(weights) == ["batch_stats/BatchNorm_0/mean", "batch_stats/BatchNorm_0/var",
                               "params/BatchNorm_0/bias", "params/BatchNorm_0/scale", "params/Dense_0/bias",
                               "params/Dense_0/kernel"]
    new = flax_adapter.restore(tree, weights)
    assert isinstance(new, FrozenDict) and new["config"] == "not an array"
    assert isinstance(new["params"]["Dense_0"]["kernel"], jax.Array)
    assert isinstance(new["params"]["Dense_0"]["bias"], np.ndarray)
    assert float(new["batch_stats"]["BatchNorm_0"]["var"][0]) == 7
    assert float(tree["batch_stats"]["BatchNorm_0"]["var"][0]) == 1  # the input is unchanged


def test_restore_of_a_pure_dict_leaves_rng_state_alone():
    """``nnx.to_pure_dict(nnx.state(model))`` of a model holding an ``nnx.Rngs`` has a typed PRNG
    key leaf, which made numpy raise TypeError, and a count beside it, which no export holds."""
    net = Net()
    pure = nnx.to_pure_dict(nnx.state(net))
    weights = random_weights()
    new = flax_adapter.restore(pure, weights)
    assert np.array_equal(new["layers"][0]["kernel"], weights["layers/0/kernel"])
    assert new["dropout"]["rngs"]["key"] is pure["dropout"]["rngs"]["key"]
    assert new["dropout"]["rngs"]["count"] is pure["dropout"]["rngs"]["count"]
    assert sorted(flax_adapter.export(pure)) == sorted(weights)
    nnx.update(net, new)
    assert np.array_equal(np.asarray(net.layers[0].kernel.get_value()), weights["layers/0/kernel"])


def test_restore_of_an_nnx_state_keys_its_variables_as_the_module_does():
    """``nnx.state(model, nnx.Param)`` holds each variable's value under a ``.value`` entry, which
    made keys like ``conv/kernel/value`` that matched no file."""
    net = Net()
    weights = random_weights()
    params = flax_adapter.restore(nnx.state(net, nnx.Param), weights, strict=False)
    everything = flax_adapter.restore(nnx.state(net), weights)
    assert sorted(flax_adapter.export(nnx.state(net))) == sorted(weights)
    for state in (params, everything):
        fresh = Net()
        nnx.update(fresh, state)
        assert np.array_equal(np.asarray(fresh.conv.kernel.get_value()), weights["conv/kernel"])


def test_restore_strict_failure_names_the_key():
    tree = linen_tree()
    with pytest.raises(AssignmentError, match="params/Dense_0/kernl"):
        flax_adapter.restore(tree, {"params/Dense_0/kernl": np.zeros((3, 2), np.float32)})
    with pytest.warns(AssignWarning, match=r"\(strict=False\) left \d+ of \d+ variables as they were") as warned:
        partial = flax_adapter.restore(tree, {"params/Dense_0/bias": np.ones(2, np.float32)}, strict=False)
    assert [w.filename for w in warned] == [__file__]
    assert partial["params"]["Dense_0"]["bias"].tolist() == [1.0, 1.0]


def test_two_leaves_with_one_key_are_refused_naming_the_key():
    tree = {"dense": {"kernel": np.ones(2, np.float32)}, "dense/kernel": np.zeros(2, np.float32)}
    with pytest.raises(ws.errors.InvalidKeyError, match="tensor 'dense/kernel': two leaves of the tree") as caught:
        flax_adapter.export(tree)
    assert (caught.value.path, caught.value.key) == (None, "dense/kernel")


def test_linen_tree_exports_in_keras_names_by_its_scopes():
    exported = flax_adapter.export(linen_tree(), layout="keras")
    assert sorted(exported) == ["batch_stats/BatchNorm_0/moving_mean", "batch_stats/BatchNorm_0/moving_variance",
                                "params/BatchNorm_0/beta", "params/BatchNorm_0/gamma", "params/Dense_0/bias",
                                "params/Dense_0/kernel"]
    with pytest.raises(LayoutError, match="params/odd/alpha"):
        flax_adapter.export({"params": {"odd": {"alpha": np.zeros(2)}}}, layout="keras")


def test_example_keras_to_flax_gives_the_same_predictions_both_ways(tmp_path, capsys):
    pytest.importorskip("keras")
    from examples import keras_to_flax

    result = keras_to_flax.main(str(tmp_path))
    assert result["to_flax"] < 1e-5 and result["back_to_keras"] < 1e-5
    assert "dw/kernel" in result["assigned"] and "bn2/var" in result["assigned"]
    assert "Keras -> Flax: 14 tensors assigned, max abs difference" in capsys.readouterr().out


def test_a_keras_transposed_kernel_is_refused_by_a_flax_conv_transpose_not_paired_by_shape():
    """Flax's ConvTranspose keeps [*spatial, in, out] unflipped, Keras's [*spatial, out, in]
    flipped: with equal channels the shapes paired and the outputs came out wrong, silently."""
    class Up(nnx.Module):
        def __init__(self):
            self.up = nnx.ConvTranspose(4, 4, (3, 3), kernel_init=ZEROS, rngs=nnx.Rngs(0))

    class Deconv(nnx.ConvTranspose):  # a subclass is one too
        pass

    module = Up()
    weights = {"up/kernel": np.ones((3, 3, 4, 4), np.float32), "up/bias": np.ones(4, np.float32)}
    with pytest.raises(AssignmentError, match="up/kernel.*Flax ConvTranspose's kernel"):
        flax_adapter.assign(module, weights, layout="keras")
    assert not np.asarray(module.up.kernel[...]).any()  # nothing changed
    module.up = Deconv(4, 4, (3, 3), kernel_init=ZEROS, rngs=nnx.Rngs(0))
    with pytest.raises(AssignmentError, match="up/kernel.*Flax ConvTranspose's kernel"):
        flax_adapter.assign(module, weights, layout="keras")
    linen = {"params": {"ConvTranspose_0": {"kernel": np.ones((3, 3, 4, 4), np.float32), "bias": np.ones(4)}}}
    with pytest.raises(AssignmentError, match="ConvTranspose_0/kernel.*Flax ConvTranspose's kernel"):
        flax_adapter.restore(linen, {"params/ConvTranspose_0/kernel": np.ones((3, 3, 4, 4), np.float32)},
                             layout="keras", strict=False)
    with pytest.raises(LayoutError, match="params/ConvTranspose_0/kernel"):
        flax_adapter.export(linen, layout="keras")


def _keras_and_flax_conv_transpose(keras):
    """A built Keras Conv2DTranspose of random weights, a Flax ConvTranspose of Keras's layout
    (``transpose_kernel=True``) and images for both."""
    layer = keras.layers.Conv2DTranspose(4, 3, padding="same")
    images = np.random.default_rng(0).normal(size=(1, 5, 5, 6)).astype("float32")
    layer.build(images.shape)
    for var in layer.weights:
        var.assign(np.random.default_rng(1).normal(size=var.shape).astype("float32"))
    return layer, nnx.ConvTranspose(6, 4, (3, 3), padding="SAME", transpose_kernel=True, rngs=nnx.Rngs(0)), images


def test_a_flax_conv_transpose_with_transpose_kernel_takes_keras_kernels_as_they_are():
    """With transpose_kernel=True a Flax ConvTranspose keeps Keras's layout, flipped as Keras's is."""
    keras = pytest.importorskip("keras")
    from weightstore.adapters import tf2

    layer, module, images = _keras_and_flax_conv_transpose(keras)
    assert flax_adapter.assign(module, tf2.export(layer), layout="keras").ok
    np.testing.assert_allclose(np.asarray(module(images)), np.asarray(layer(images)), atol=1e-5)
    for key, value in flax_adapter.export(module, layout="keras").items():
        np.testing.assert_array_equal(value, tf2.export(layer)[key])


def test_a_follower_converts_keras_versions_into_a_flax_module_and_refuses_an_unknown_layout_at_once(tmp_path):
    """``Follower(module, folder, layout="keras")`` assigns each version as ``assign(layout=)``
    does; a misspelt layout fails at construction, naming the folder, not on every version."""
    keras = pytest.importorskip("keras")
    from weightstore.adapters import tf2
    from weightstore.adapters.serving.follower import Follower

    layer, module, images = _keras_and_flax_conv_transpose(keras)
    ws.publish(tmp_path, tf2.export(layer), step=1)
    with Follower(module, tmp_path, poll=0.005, layout="keras") as follower:
        assert follower.wait(1, timeout=60).step == 1
        with follower.reading():
            np.testing.assert_allclose(np.asarray(module(images)), np.asarray(layer(images)), atol=1e-5)
    assert follower.error is None
    with pytest.raises(LayoutError, match=f"^{tmp_path}: unknown layout 'kerass'"):
        Follower(module, tmp_path, layout="kerass")


def test_an_assigned_model_holds_its_own_memory_not_the_files(tmp_path):
    """Values from a local npz are views of the mapped file; JAX kept them as the arrays' memory,
    so rewriting the file in place changed the model (and truncating it killed the process)."""
    path = tmp_path / "w.npz"
    ws.save(path, random_weights())
    module = Net()
    flax_adapter.assign(module, path)
    tree = flax_adapter.restore({"conv": {"kernel": jax.numpy.zeros((3, 3, 2, 3))}}, path, strict=False)
    before = np.asarray(module.conv.kernel[...]).copy()
    ws.save(tmp_path / "other.npz", random_weights(seed=2))
    with open(path, "r+b") as handle:  # what cp other.npz w.npz does: the same file, rewritten in place
        handle.write((tmp_path / "other.npz").read_bytes())
    np.testing.assert_array_equal(np.asarray(module.conv.kernel[...]), before)
    np.testing.assert_array_equal(np.asarray(tree["conv"]["kernel"]), before)


def test_restore_with_cast_refuses_values_the_leaf_cannot_hold():
    """restore skipped the range check assign makes: 1e300 became inf and 300 became 44."""
    for leaf, value in ((np.zeros(2, np.float32), np.array([1.0, 1e300])), (np.zeros(2, np.int8), np.array([300, 1]))):
        with pytest.raises(AssignmentError, match="'w'"):
            flax_adapter.restore({"w": leaf}, {"w": value}, cast=True)


def test_a_python_number_param_is_assigned():
    class Scaled(nnx.Module):
        def __init__(self):
            self.t = nnx.Param(1.0)

    module = Scaled()
    assert flax_adapter.assign(module, {"t": np.array(2.5)}, cast=True).ok
    assert float(module.t[...]) == 2.5


def test_a_grouped_conv_converts_both_ways():
    keras = pytest.importorskip("keras")
    layer = keras.layers.Conv2D(6, 3, groups=2)
    images = np.random.default_rng(0).normal(size=(1, 5, 5, 4)).astype("float32")
    layer.build(images.shape)
    for var in layer.weights:
        var.assign(np.random.default_rng(1).normal(size=var.shape).astype("float32"))
    from weightstore.adapters import tf2

    module = nnx.Conv(4, 6, (3, 3), feature_group_count=2, padding="VALID", rngs=nnx.Rngs(0))
    assert flax_adapter.assign(module, tf2.export(layer), layout="keras").ok
    np.testing.assert_allclose(np.asarray(module(images)), np.asarray(layer(images)), atol=1e-5)
    for key, value in flax_adapter.export(module, layout="keras").items():
        np.testing.assert_array_equal(value, tf2.export(layer)[key])


def test_an_abstract_model_is_assigned_and_restored_as_jax_arrays_where_its_shapes_say():
    """nnx.eval_shape's model holds ShapeDtypeStructs: assign left host numpy arrays (dropping
    any sharding they named), and restore of its state found no leaves at all."""
    abstract = nnx.eval_shape(lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    weights = {"kernel": np.arange(6, dtype=np.float32).reshape(3, 2), "bias": np.ones(2, np.float32)}
    assert flax_adapter.assign(abstract, weights).ok
    assert isinstance(abstract.kernel[...], jax.Array)
    np.testing.assert_array_equal(np.asarray(abstract.kernel[...]), weights["kernel"])
    state = nnx.state(nnx.eval_shape(lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(0))))
    restored = flax_adapter.restore(state, weights)
    np.testing.assert_array_equal(np.asarray(restored["kernel"][...]), weights["kernel"])
    with_streams = flax_adapter.restore(nnx.state(nnx.eval_shape(Net)), random_weights())  # RNG keys: left alone
    np.testing.assert_array_equal(np.asarray(with_streams["conv"]["kernel"][...]), random_weights()["conv/kernel"])
    with pytest.raises(SelectionError, match="abstract"):  # shapes, no values: nothing to write
        flax_adapter.export(nnx.eval_shape(Net))


class Mlp(nnx.Module):
    """Random weights (unlike :class:`Net`): a follower that left one untouched would show."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def test_a_follower_keeps_an_nnx_module_at_each_version_plain_or_sharded(tmp_path):
    """The follower finds the module's adapter in the registry: each version is assigned, and the
    model predicts as the trainer's own module does (a sharded one staged by region)."""
    from weightstore.adapters.serving.follower import Follower

    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    served = Mlp(seed=0)
    with Follower(served, tmp_path, poll=0.005) as follower:
        for step, seed in ((1, 1), (2, 2)):
            trainer = Mlp(seed=seed)
            ws.publish(tmp_path, flax_adapter.export(trainer), step=step)
            assert follower.wait(step, timeout=60).step == step, follower.error
            with follower.reading():
                np.testing.assert_array_equal(np.asarray(served(x)), np.asarray(trainer(x)))
        trainer = Mlp(seed=3)
        ws.publish_shard(tmp_path, flax_adapter.export_pieces(trainer), step=3, rank=0, world=1, attempt=0)
        ws.commit_shards(tmp_path, step=3, world=1, attempt=0, timeout=10)
        assert follower.wait(3, timeout=60).step == 3, follower.error
        with follower.reading():
            np.testing.assert_array_equal(np.asarray(served(x)), np.asarray(trainer(x)))
    assert sorted(follower.report.assigned) == sorted(flax_adapter.export(trainer))


def test_a_follower_refuses_a_parameter_tree_it_could_only_replace(tmp_path):
    """A Linen tree's leaves are values (``restore`` makes a new tree), so no version could be
    written into it: refused at construction, not failed at every version."""
    from weightstore.adapters.serving.follower import Follower

    tree = {"params": {"Dense_0": {"kernel": jax.numpy.ones((2, 2))}}}
    with pytest.raises(ws.UnsupportedTargetError, match=r"in place.*flax\.assign cannot do for a dict.*restore"):
        Follower(tree, tmp_path)


def test_variables_are_what_export_reads_and_what_assign_writes():
    net = Net()
    found = flax_adapter.variables(net)
    assert sorted(found) == sorted(flax_adapter.export(net)) and found["bn/mean"] is net.bn.mean
    assert sorted(flax_adapter.variables(net, scope="bn", trainable_only=True)) == ["bias", "scale"]
    with pytest.raises(TypeError, match="pytree holds values"):
        flax_adapter.variables({"w": np.ones(2)})


def test_a_member_assigned_into_a_vmapped_ensemble_is_told_the_target_stacks_members(tmp_path):
    """``nnx.vmap`` stacks an ensemble's parameters on axis 0: a member's file was refused as
    "shapes differ" with no word of why. The message says how many members the target stacks
    and how to assign them all, or one."""
    @nnx.vmap(in_axes=0, out_axes=0)
    def ensemble(rngs):
        return nnx.Linear(3, 2, kernel_init=ZEROS, rngs=rngs)

    stacked = ensemble(nnx.Rngs(0).fork(split=4))
    member = flax_adapter.export(nnx.Linear(3, 2, kernel_init=ZEROS, rngs=nnx.Rngs(1)))
    ws.save(tmp_path / "member.npz", member)
    with pytest.raises(AssignmentError, match="shapes differ") as info:
        flax_adapter.assign(stacked, tmp_path / "member.npz")
    assert "4 members stacked on axis 0" in str(info.value), info.value
    assert "np.stack" in str(info.value) and "export" in str(info.value)
    every = {key: np.stack([value] * 4) for key, value in member.items()}  # the way the message gives
    flax_adapter.assign(stacked, every)
    np.testing.assert_array_equal(flax_adapter.export(stacked)["kernel"][2], member["kernel"])


def test_scope_naming_a_part_of_an_ensembles_file_says_ws_load_takes_it_out(tmp_path):
    """``flax.assign(member, ensemble_file, scope="b")`` (scope read as "take b out of the file")
    said only that no variable is under 'b'; it now names ``ws.load(path, scope='b')``, which works."""
    pair = nnx.Dict(a=Net(seed=1), b=Net(seed=2))
    flax_adapter.assign(pair.b, random_weights(seed=3))
    ws.save(tmp_path / "pair.npz", flax_adapter.export(pair))
    member = Net(seed=4)
    with pytest.raises(AssignmentError, match=r"no variable is under scope 'b', which scope= puts the values "
                                              r"under; they are under it already: to take that part of the file "
                                              r"out, assign ws.load\(path, scope='b'\)"):
        flax_adapter.assign(member, tmp_path / "pair.npz", scope="b")
    flax_adapter.assign(member, ws.load(tmp_path / "pair.npz", scope="b"))
    for key, value in random_weights(seed=3).items():
        np.testing.assert_array_equal(flax_adapter.export(member)[key], value)


def test_an_orbax_checkpoint_is_refused_naming_orbax_and_how_to_export_it(tmp_path):
    """Flax's own saver is Orbax; its folder was refused as holding "no TF checkpoint (no
    'checkpoint' state file, no .index file)", which says nothing to a Flax user. It names
    Orbax and the restore-then-export that gives a file, which then assigns."""
    ocp = pytest.importorskip("orbax.checkpoint")
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", state)
    for reads in (ws.load, lambda path: flax_adapter.assign(model, path)):
        with pytest.raises(ws.StoreNotFoundError, match=r"is an Orbax checkpoint .*flax\.export\(model\)") as caught:
            reads(tmp_path / "orbax")
        assert caught.value.path == str(tmp_path / "orbax")
    with ocp.StandardCheckpointer() as checkpointer:
        nnx.update(model, checkpointer.restore(tmp_path / "orbax", state))
    ws.save(tmp_path / "m.npz", flax_adapter.export(model))
    assert flax_adapter.assign(nnx.Linear(3, 2, rngs=nnx.Rngs(1)), tmp_path / "m.npz").ok
