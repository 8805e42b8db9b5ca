"""What a Keras user loads behaves like the model that was saved: layers whose state derives
from their variables, keys as Keras names layers, selections that must match something.

Every check compares with what Keras's own ``load_weights`` leaves, on models built here.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import weightstore as ws  # noqa: E402
from weightstore.adapters import tf2  # noqa: E402
from weightstore.adapters.follower import Follower  # noqa: E402

RNG = np.random.default_rng(19)
X = RNG.normal(5, 3, (8, 3)).astype("float32")


def normalized(data):
    """Normalization adapted to ``data``, then Dense: the layer divides by constants made from its variables."""
    norm = keras.layers.Normalization()
    norm.adapt(data)
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2)(norm(inputs)))


@pytest.fixture(scope="module")
def saved_normalized(tmp_path_factory):
    """A model adapted to data around 5 and its ``save_weights`` file."""
    model = normalized(RNG.normal(5, 3, (64, 3)).astype("float32"))
    path = tmp_path_factory.mktemp("norm") / "m.weights.h5"
    model.save_weights(path)
    return model, str(path)


def keras_loaded(build, path):
    model = build()
    model.load_weights(path)
    return model


def fresh_normalized():
    return normalized(RNG.normal(0, 1, (64, 3)).astype("float32"))


# --- layers finalized after an assign, as Keras's loaders leave them -------------------------

@pytest.mark.parametrize("source", ["keras file", "dict", "npz"])
def test_adapted_normalization_predicts_as_load_weights_after_assign(saved_normalized, source, tmp_path):
    saved, path = saved_normalized
    weights = {"keras file": path, "dict": tf2.export(saved), "npz": str(tmp_path / "w.npz")}[source]
    if source == "npz":
        ws.save(weights, tf2.export(saved))
    model = fresh_normalized()
    tf2.assign(model, weights)
    expected = keras_loaded(fresh_normalized, path)(X)
    np.testing.assert_array_equal(model(X), expected)
    np.testing.assert_array_equal(model(X), saved(X))


def test_follower_swap_finalizes_normalization(saved_normalized, tmp_path):
    saved, path = saved_normalized
    model = fresh_normalized()
    ws.publish(tmp_path, tf2.export(saved), step=1)
    with Follower(model, tmp_path, poll=0.005) as follower:
        follower.wait(1, timeout=30)
        with follower.reading():
            np.testing.assert_array_equal(model(X), keras_loaded(fresh_normalized, path)(X))


def test_normalization_in_a_nested_model_and_a_module_is_finalized(saved_normalized):
    saved, _ = saved_normalized
    inner = fresh_normalized()
    inputs = keras.Input((3,))
    outer = keras.Model(inputs, inner(inputs))
    tf2.assign(outer, {f"{tf2_key_of(outer)}/{key}": value for key, value in tf2.export(saved).items()})
    np.testing.assert_array_equal(outer(X), saved(X))
    holder = tf.Module()
    holder.net = fresh_normalized()
    tf2.assign(holder, {f"net/{key}": value for key, value in tf2.export(saved).items()})
    np.testing.assert_array_equal(holder.net(X), saved(X))


def tf2_key_of(outer):
    """The key segment ``tf2`` gives the only model nested in ``outer``."""
    return next(iter(tf2.variables(outer))).split("/")[0]


def discretized(bins):
    layer = keras.layers.Discretization(bin_boundaries=bins)
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2)(layer(inputs)))


def test_discretization_keeps_its_own_bins_as_load_weights_does(tmp_path):
    """Discretization's bins are config, not variables: assign and ``load_weights`` both keep the target's."""
    saved = discretized([0.0, 5.0])
    path = str(tmp_path / "d.weights.h5")
    saved.save_weights(path)
    model = discretized([-1.0, 1.0])
    tf2.assign(model, path)
    np.testing.assert_array_equal(model(X), keras_loaded(lambda: discretized([-1.0, 1.0]), path)(X))


def looked_up(vocabulary):
    lookup = keras.layers.StringLookup(output_mode="multi_hot")
    lookup.adapt(vocabulary)
    inputs = keras.Input((2,), dtype="string")
    return keras.Model(inputs, keras.layers.Dense(2)(lookup(inputs)))


def test_adapted_lookup_keeps_its_vocabulary_as_load_weights_does(tmp_path):
    """A lookup layer's vocabulary is an asset, not a variable: both keep the target's, the Dense changes."""
    saved = looked_up([["a", "b"], ["a", "c"]])
    path = str(tmp_path / "l.weights.h5")
    saved.save_weights(path)
    model = looked_up([["c", "b"], ["c", "a"]])
    tf2.assign(model, path)
    words = tf.constant([["a", "b"], ["c", "x"]])
    np.testing.assert_array_equal(model(words), keras_loaded(lambda: looked_up([["c", "b"], ["c", "a"]]), path)(words))


# --- a selection word that matches nothing is an error naming the closest key ---------------

def batch_normed(bn_name=None):
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(name=bn_name),
                             keras.layers.Dense(2)], name="net")


@pytest.mark.parametrize(("bn_name", "closest"), [(None, "batch_normalization/moving_mean"), ("bn", "bn/moving_mean")],
                         ids=["default-named", "top-level"])
def test_also_matching_nothing_names_the_closest_key(bn_name, closest):
    model = batch_normed(bn_name)
    with pytest.raises(ws.SelectionError) as caught:
        tf2.export(model, trainable_only=True, also="*/bn/moving_*")
    assert str(caught.value) == f"also '*/bn/moving_*' matches no key in Sequential 'net'; did you mean {closest!r}?"
    before = tf2.export(model)
    with pytest.raises(ws.SelectionError) as caught:
        tf2.assign(model, {key: value + 1 for key, value in before.items()}, trainable_only=True, also="*/bn/moving_*")
    assert str(caught.value) == f"also '*/bn/moving_*' matches no key in the model's variables; did you mean {closest!r}?"
    assert all(np.array_equal(value, before[key]) for key, value in tf2.export(model).items())  # nothing changed


def test_include_word_matching_nothing_is_an_error_even_beside_one_that_matches():
    model = batch_normed("bn")
    with pytest.raises(ws.SelectionError) as caught:
        tf2.export(model, include=["dense", "bn/moving_men"])
    assert str(caught.value) == "include 'bn/moving_men' matches no key in Sequential 'net'; did you mean 'bn/moving_mean'?"
