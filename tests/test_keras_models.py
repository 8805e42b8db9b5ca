"""What a Keras user loads behaves like the model that was saved: layers whose state derives
from their variables, keys as Keras names layers, selections that must match something.

Every check compares with what Keras's own ``load_weights`` leaves, on models built here.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import weightstore as ws  # noqa: E402
from weightstore.adapters import tf2  # noqa: E402
from weightstore.adapters.serving.follower import Follower  # noqa: E402

RNG = np.random.default_rng(19)
BUCKET = "weightstore-keras-models"  # the loopback S3 server's (conftest ``server``)
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


def tf_idf(idf, layer="IntegerLookup"):
    """A lookup layer in tf_idf mode, then Dense: its ``idf_weights`` are a TensorFlow variable
    outside ``layer.weights``, which Keras's files save and ``load_weights`` restores
    (TextVectorization saves its lookup layer's under its own name too)."""
    if layer == "IntegerLookup":
        lookup = keras.layers.IntegerLookup(vocabulary=[1, 2, 3], idf_weights=idf, output_mode="tf_idf")
        inputs = keras.Input((3,), dtype="int64")
    else:
        lookup = keras.layers.TextVectorization(vocabulary=["1", "2", "3"], idf_weights=idf, output_mode="tf_idf",
                                                split=None, standardize=None)
        inputs = keras.Input((1,), dtype="string")
    return keras.Model(inputs, keras.layers.Dense(2, kernel_initializer="ones")(lookup(inputs)))


@pytest.mark.parametrize("layer", ["IntegerLookup", "TextVectorization"])
@pytest.mark.parametrize("source", ["npz", "keras file", "keras archive"])
def test_tf_idf_weights_travel_as_load_weights_restores_them(source, layer, tmp_path):
    """They were left out of an export (a strict assign then kept the target's, and predicted
    otherwise) and refused from a Keras file as "no variable"."""
    saved = tf_idf([1.0, 2.0, 3.0], layer)
    path = str(tmp_path / {"npz": "w.npz", "keras file": "w.weights.h5", "keras archive": "w.keras"}[source])
    if source == "npz":
        ws.save(path, tf2.export(saved))
    elif source == "keras file":
        saved.save_weights(path)
    else:
        saved.save(path)
    model = tf_idf([9.0, 9.0, 9.0], layer)
    assert tf2.assign(model, path).ok
    x = np.array([[1, 2, 3], [3, 3, 2]]) if layer == "IntegerLookup" else np.array([["1"], ["3"], ["2"]])
    expected = keras_loaded(lambda: tf_idf([9.0, 9.0, 9.0], layer), path)(x) if source != "npz" else saved(x)
    np.testing.assert_array_equal(model(x), expected)
    np.testing.assert_array_equal(model(x), saved(x))


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


# --- keys: stable across instances, Keras's own names in a process's first model -------------

def bilstm():
    inputs = keras.Input((5, 3))
    x = keras.layers.Bidirectional(keras.layers.LSTM(4, return_sequences=True))(inputs)
    x = keras.layers.Bidirectional(keras.layers.GRU(3))(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def time_distributed():
    inputs = keras.Input((5, 3))
    return keras.Model(inputs, keras.layers.TimeDistributed(keras.layers.Dense(4))(inputs))


def transformer_block():
    inputs = keras.Input((6, 8))
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    x = keras.layers.LayerNormalization()(inputs + attended)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(8)(keras.layers.Dense(16, activation="relu")(x)))
    return keras.Model(inputs, x)


def holding_a_model():
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(4)])
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2)(inner(inputs)))


def out_of_order():
    """The second Dense is made first: Keras names it ``dense``, though it comes second in the graph."""
    second, first = keras.layers.Dense(2), keras.layers.Dense(3)
    inputs = keras.Input((3,))
    return keras.Model(inputs, second(first(inputs)))


def mobilenet():
    return keras.applications.MobileNet(input_shape=(32, 32, 3), alpha=0.25, weights=None, classes=3)


ARCHITECTURES = {"bilstm": (bilstm, (2, 5, 3)), "time_distributed": (time_distributed, (2, 5, 3)),
                 "transformer": (transformer_block, (2, 6, 8)), "nested": (holding_a_model, (2, 3)),
                 "out_of_order": (out_of_order, (2, 3)), "mobilenet": (mobilenet, (1, 32, 32, 3))}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def two_instances(request):
    build, shape = ARCHITECTURES[request.param]
    return build(), build(), RNG.normal(size=shape).astype("float32")


def test_two_instances_have_one_set_of_keys_and_trade_weights(two_instances, tmp_path):
    first, second, x = two_instances
    assert tf2.keys(first) == tf2.keys(second)
    ws.save(tmp_path / "w.npz", tf2.export(first))
    report = tf2.assign(second, tmp_path / "w.npz")
    assert report.ok and len(report.assigned) == len(tf2.keys(first))
    np.testing.assert_array_equal(second(x), first(x))


def test_wrappers_key_their_copies_without_instance_numbers():
    assert tf2.keys(bilstm())[:3] == ["bidirectional/forward_lstm/lstm_cell/kernel",
                                      "bidirectional/forward_lstm/lstm_cell/recurrent_kernel",
                                      "bidirectional/forward_lstm/lstm_cell/bias"]
    assert "bidirectional_1/backward_gru/gru_cell/bias" in tf2.keys(bilstm())
    assert tf2.keys(time_distributed()) == ["time_distributed/dense/kernel", "time_distributed/dense/bias"]


def test_a_chosen_name_that_looks_like_a_wrappers_copy_is_kept_and_numbers_nothing(tmp_path):
    """``forward_dense`` chosen by the user is no ``Bidirectional`` copy: it must not count as an
    automatic ``dense``, or every later instance's automatic Dense is keyed ``dense_1``."""
    def net() -> keras.Model:
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="forward_dense"), keras.layers.Dense(2)])

    first, second = net(), net()
    assert tf2.keys(first) == tf2.keys(second) == ["forward_dense/kernel", "forward_dense/bias",
                                                   "dense/kernel", "dense/bias"]
    assert tf2.assign(first, tf2.export(second)).ok


FIRST_IN_PROCESS = """
import json, keras
from tests.test_keras_models import ARCHITECTURES
from weightstore.adapters import tf2
out = {}
for name in ("out_of_order", "nested", "bilstm", "time_distributed"):
    model = ARCHITECTURES[name][0]()
    names = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        for var in layer.weights:
            names[id(var)] = layer  # pre-order: the deepest layer holding it wins
    paths = {}
    def walk(layer, prefix):
        for child in layer._flatten_layers(include_self=False, recursive=False):
            paths[id(child)] = prefix + child.name
            walk(child, prefix + child.name + "/")
    walk(model, "")
    out[name] = [[key, paths[id(names[id(var)])]] for key, var in tf2.variables(model).items()]
    keras.backend.clear_session()  # the next model is again the first of its process, as Keras counts
print(json.dumps(out))
"""


def test_in_a_fresh_process_keys_are_the_layer_names_keras_shows(tf_fork):
    """Keras's own names (``layer.name``, ``model.summary()``) for the first model of a process
    (forked from one that imported Keras and built no model: ``conftest.tf_fork``)."""
    import json

    done = tf_fork.run(FIRST_IN_PROCESS, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    for name, pairs in json.loads(done.stdout.splitlines()[-1]).items():
        for key, layer_path in pairs:
            assert key.rsplit("/", 1)[0] == layer_path, name


def test_keys_of_earlier_releases_still_assign():
    """Earlier releases numbered automatic names per parent in layer order: the outer Dense of a
    model holding a model was ``dense``, the later-made first Dense of a graph ``dense``."""
    model = holding_a_model()
    values = {key: RNG.normal(size=np.shape(value)).astype("float32") for key, value in tf2.export(model).items()}
    old = {key.replace("dense_2/", "dense/", 1) if key.startswith("dense_2/") else key: value
           for key, value in values.items()}
    assert "dense/kernel" in old and tf2.assign(model, old).ok
    for key, value in tf2.export(model).items():
        np.testing.assert_array_equal(value, values[key])


@pytest.mark.parametrize("strict", [True, False])
def test_keys_of_earlier_releases_that_name_other_layers_today_assign_to_their_own(strict):
    """A nested model's old keys are today's shifted by one: its old ``dense_1`` (second Dense)
    is a key today too, of its first Dense. Renamed one at a time, that value went into the
    first Dense (with strict=False, silently); the file is read in the old naming as a whole."""
    def make():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.Sequential(
            [keras.layers.Dense(4), keras.layers.Dense(4)])])

    source, target = make(), make()
    now = tf2.export(source)
    old_name = {"dense": "dense", "sequential/dense_1": "sequential/dense", "sequential/dense_2": "sequential/dense_1"}
    old = {f"{old_name[key.rsplit('/', 1)[0]]}/{key.rsplit('/', 1)[1]}": value for key, value in now.items()}
    assert set(old) & set(now)  # keys valid in both namings, meaning other layers
    report = tf2.assign(target, old, strict=strict)
    assert report.ok and len(report.assigned) == len(now)
    x = RNG.normal(size=(2, 4)).astype("float32")
    np.testing.assert_array_equal(target(x), source(x))


def ensemble_of_two() -> tuple:
    """Two members of one architecture side by side, ``member_0`` and ``member_1``."""
    inputs = keras.Input((3,))
    members = [holding_a_model() for _ in range(2)]
    for i, member in enumerate(members):
        member.name = f"member_{i}"
    return keras.Model(inputs, [member(inputs) for member in members]), members


def test_one_member_of_an_ensemble_assigns_into_another_by_scope():
    ensemble, members = ensemble_of_two()
    keys = tf2.keys(ensemble)
    assert "member_1/sequential_1/dense_3/kernel" in keys  # numbered from the root, as Keras shows them
    part = tf2.export(members[0])  # a member on its own: numbered from itself, like any model
    assert list(part) == tf2.keys(holding_a_model())
    report = tf2.assign(ensemble, {key: value + 1 for key, value in part.items()}, scope="member_1")
    assert report.ok and len(report.assigned) == len(part)
    for key, value in tf2.export(members[1]).items():
        np.testing.assert_array_equal(value, tf2.export(members[0])[key] + 1)


@pytest.mark.parametrize("source", ["npz", "weights.h5"])
def test_selection_words_under_a_scope_name_the_members_own_keys_in_assign_as_in_export(tmp_path, source):
    """``exclude``, ``include`` and ``also`` under ``scope`` pick the member's variables by the
    keys ``tf2.export(ensemble, scope=member)`` gives them, whatever the ensemble numbers them."""
    ensemble, members = ensemble_of_two()
    path = tmp_path / f"member.{source}"
    lone = holding_a_model()
    for var in lone.weights:
        var.assign(RNG.normal(size=var.shape).astype("float32"))
    if source == "npz":
        ws.save(path, tf2.export(lone))
    else:
        lone.save_weights(path)
    own = tf2.export(ensemble, scope="member_1")
    kept = "dense_2/kernel"
    assert kept in own and f"member_1/{kept}" not in tf2.keys(ensemble)  # the ensemble numbers it dense_5
    before = tf2.export(ensemble, scope="member_1")
    report = tf2.assign(ensemble, path, scope="member_1", exclude=kept)
    assert report.ok and f"member_1/{kept}" not in report.assigned and len(report.assigned) == len(own) - 1
    after = tf2.export(ensemble, scope="member_1")
    np.testing.assert_array_equal(after[kept], before[kept])  # excluded: as it was
    np.testing.assert_array_equal(after["dense_2/bias"], tf2.export(lone)["dense_2/bias"])
    assert tf2.assign(ensemble, path, scope="member_1", include=kept).assigned == [f"member_1/{kept}"]
    np.testing.assert_array_equal(tf2.export(ensemble, scope="member_1")[kept], tf2.export(lone)[kept])
    assert (sorted(tf2.export(ensemble, scope="member_1", include=kept))
            == sorted(key.removeprefix("member_1/") for key in tf2.assign(ensemble, path, scope="member_1",
                                                                         include=kept).assigned))


def test_under_a_scope_keys_of_the_whole_model_pair_with_the_layers_they_name_there():
    """``member_1``'s own ``dense_1`` is its second Dense; the ensemble's ``dense_1`` its first.
    Values keyed as ``tf2.export(ensemble)`` keys them, scope cut off, pair in that naming."""
    inputs = keras.Input((3,))
    first = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)], name="member_0")
    second = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.Dense(3)], name="member_1")
    ensemble = keras.Model(inputs, [first(inputs), second(inputs)])
    whole = {key.removeprefix("member_1/"): RNG.normal(size=np.shape(value)).astype("float32")
             for key, value in tf2.export(ensemble).items() if key.startswith("member_1/")}
    assert sorted(whole) == ["dense_1/bias", "dense_1/kernel", "dense_2/bias", "dense_2/kernel"]
    assert tf2.assign(ensemble, whole, scope="member_1").ok
    np.testing.assert_array_equal(second.layers[0].kernel.numpy(), whole["dense_1/kernel"])
    np.testing.assert_array_equal(second.layers[1].kernel.numpy(), whole["dense_2/kernel"])
    own = tf2.export(second)  # the member's own keys: dense, dense_1
    assert tf2.assign(ensemble, {key: value + 1 for key, value in own.items()}, scope="member_1").ok
    np.testing.assert_array_equal(second.layers[1].kernel.numpy(), own["dense_1/kernel"] + 1)


def test_one_member_read_by_scope_from_the_ensembles_file_assigns_into_a_lone_instance(tmp_path):
    """``ws export ensemble.keras --scope member_1`` keys the member as the ensemble numbers it
    (``sequential_1/dense_3``, as ``tf2.export(ensemble)`` does, the scope cut off): those keys,
    renumbered as the member's own root would number them, pair with a lone member whole."""
    ensemble, members = ensemble_of_two()
    for member in members:
        for var in member.weights:
            var.assign(RNG.normal(size=var.shape).astype("float32"))
    ensemble.save(tmp_path / "ensemble.keras")
    out = tmp_path / "member_1.npz"
    done = subprocess.run([sys.executable, "-m", "weightstore", "export", str(tmp_path / "ensemble.keras"),
                           "-o", str(out), "--scope", "member_1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "sequential_1/dense_3/kernel" in ws.load(out)  # the ensemble's numbering
    for weights in (out, ws.load(tmp_path / "ensemble.keras", scope="member_1")):
        lone = holding_a_model()
        report = tf2.assign(lone, weights)
        assert report.ok and len(report.assigned) == len(lone.weights)
        for key, value in tf2.export(members[1]).items():
            np.testing.assert_array_equal(tf2.export(lone)[key], value)



def test_a_member_read_out_of_a_trained_ensembles_file_pairs_with_a_lone_model_asked_for_its_optimizer(tmp_path):
    """The renumbering counted the lone model's optimizer slots as part of it (``optimizer=True``),
    so the member's ``dense_2``/``dense_3`` were not renamed to its ``dense``/``dense_1`` and
    nothing paired. Trained one step with Adam each: the layers pair; the slots, which the
    ensemble's file holds only as the ensemble's, are named missing, or come from the lone's own."""
    def member():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])

    def trained(model, outputs):
        model.compile(optimizer="adam", loss="mse")
        model.fit(X, [RNG.normal(size=(len(X), 2)).astype("float32")] * outputs, epochs=1, verbose=0)
        return model

    inputs = keras.Input((3,))
    members = [member() for _ in range(2)]
    for i, one in enumerate(members):
        one.name = f"member_{i}"
    trained(keras.Model(inputs, [one(inputs) for one in members]), 2).save(tmp_path / "ensemble.keras")
    values = ws.load(tmp_path / "ensemble.keras", scope="member_1")
    assert sorted(values) == ["dense_2/bias", "dense_2/kernel", "dense_3/bias", "dense_3/kernel"]
    lone = trained(member(), 1)
    slots = {key: value for key, value in tf2.export(lone, optimizer=True).items() if key.startswith("optimizer/")}
    assert slots
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(lone, values, optimizer=True)
    assert "optimizer/vars/0" in str(caught.value) and "dense_2" not in str(caught.value)
    with pytest.warns(UserWarning, match="left 10 of 14 variables"):
        report = tf2.assign(lone, values, optimizer=True, strict=False)
    assert sorted(report.assigned) == ["dense/bias", "dense/kernel", "dense_1/bias", "dense_1/kernel"]
    report = tf2.assign(lone, {**values, **{key: value + 1 for key, value in slots.items()}}, optimizer=True)
    assert report.ok and len(report.assigned) == 4 + len(slots)
    exported = tf2.export(lone, optimizer=True)
    for key, value in tf2.export(members[1]).items():
        np.testing.assert_array_equal(exported[key], value)
    for key, value in slots.items():
        np.testing.assert_array_equal(exported[key], value + 1)


@pytest.mark.parametrize("name, said, second", [
    ("ensemble.npz", "the values are under 'member_0' and 'member_1' (an ensemble, each holding the variables' keys) "
                     "and the variables are not: assign one of them, ws.load(path, scope='member_0')", "member_1"),
    ("ensemble.keras", "holds an ensemble, the model's variables under each of 'member_0', 'member_1': assign one "
                       "member, ws.load(path, scope='member_0')", "member_1"),
    ("ensemble.weights.h5", "holds an ensemble, the model's variables under each of 'layers/functional', "
                            "'layers/functional_1' (Keras names the members by their class, in layer order): assign "
                            "one member, ws.load(path, scope='layers/functional')", "layers/functional_1"),
])
def test_the_ensembles_own_file_given_to_a_lone_member_names_the_members_and_how_to_take_one_out(
        tmp_path, name, said, second):
    """``tf2.assign(lone, ensemble.npz)``, the scope forgotten: the ensemble numbers its members'
    automatic names on (``member_1/sequential_1/dense_3/kernel``), so no key of a member pairs a
    variable, and the message said the two "look like different architectures" (a ``.keras``'s
    save walk pairs none either, nor a ``.weights.h5``'s, whose members Keras names by class,
    ``layers/functional_1/...``). It names the members' scopes and the load that takes one out,
    and that load assigns."""
    ensemble, members = ensemble_of_two()
    for var in ensemble.weights:
        var.assign(RNG.normal(size=var.shape).astype("float32"))
    if name.endswith(".keras"):
        ensemble.save(tmp_path / name)
    elif name.endswith(".weights.h5"):
        ensemble.save_weights(tmp_path / name)
    else:
        ws.save(tmp_path / name, tf2.export(ensemble))
    lone = holding_a_model()
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(lone, tmp_path / name)
    assert said in str(caught.value) and caught.value.path == str(tmp_path / name)
    assert sorted(caught.value.missing) == sorted(tf2.keys(lone))  # the plan's keys, for callers
    tf2.assign(lone, ws.load(tmp_path / name, scope=second))
    for key, value in tf2.export(members[1]).items():
        np.testing.assert_array_equal(tf2.export(lone)[key], value)


def _widths_ensemble(widths):
    """An ensemble of one Sequential per width, ``model_001``, ``model_002``…: members that
    share every key (Keras numbers each member's automatic names on) and differ in shapes."""
    def member(width, name=None):
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(width), keras.layers.Dense(1)], name=name)

    inputs = keras.Input((4,))
    parts = [member(width, f"model_{i:03d}") for i, width in enumerate(widths, start=1)]
    ensemble = keras.Model(inputs, keras.layers.Concatenate()([part(inputs) for part in parts]))
    for var in ensemble.weights:
        var.assign(RNG.normal(size=var.shape).astype("float32"))
    return ensemble, parts, member


@pytest.mark.parametrize("name, said", [
    ("ensemble.npz", "(an ensemble, each holding the variables' keys; of those, only 'model_002' has the variables' "
                     "shapes) and the variables are not: assign one of them, ws.load(path, scope='model_002')"),
    ("ensemble.keras", "(of those, only 'model_002' has the model's shapes): assign one member, "
                       "ws.load(path, scope='model_002')"),
    ("ensemble.weights.h5", "(Keras names the members by their class, in layer order; of those, only "
                            "'layers/sequential_1' has the model's shapes): assign one member, "
                            "ws.load(path, scope='layers/sequential_1')"),
    ("member.npz", "the variables are under 'model_001' and 'model_002' (of those, only 'model_002' has the "
                   "values' shapes) and the values are not: pass scope='model_002'"),
])
def test_the_ensemble_hint_proposes_the_member_of_the_models_shapes(tmp_path, name, said):
    """Members of different widths share every key: an ensemble's file given to a lone member
    (or a member's file to the ensemble, the scope forgotten) proposed the first member by name,
    whose shapes the model does not have, so following the hint failed again. The hint names the
    member whose shapes fit, and following it assigns the values (predictions equal)."""
    ensemble, parts, member = _widths_ensemble([8, 16])
    lone = member(16)
    lone.set_weights([RNG.normal(size=w.shape).astype("float32") for w in lone.get_weights()])
    x = RNG.normal(size=(5, 4)).astype("float32")
    path = tmp_path / name
    if name == "member.npz":
        ws.save(path, tf2.export(lone))
        source, target = lone, parts[1]
    else:
        if name.endswith(".keras"):
            ensemble.save(path)
        elif name.endswith(".weights.h5"):
            ensemble.save_weights(path)
        else:
            ws.save(path, tf2.export(ensemble))
        source, target = parts[1], lone
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(ensemble if name == "member.npz" else lone, path)
    assert said in str(caught.value)
    scope = str(caught.value).rsplit("scope=", 1)[1].split("'")[1]  # followed as a user would
    if name == "member.npz":
        tf2.assign(ensemble, path, scope=scope)
    else:
        tf2.assign(lone, ws.load(path, scope=scope))
    np.testing.assert_array_equal(np.asarray(target(x)), np.asarray(source(x)))


def test_a_lone_members_file_imports_into_the_ensembles_keras_file_by_scope(tmp_path):
    """``ws import member.npz --into ensemble.keras --scope member_1``: the member's own keys
    (``sequential/dense``) go where the ensemble numbers them (``sequential_1/dense_3``), as
    ``tf2.assign(ensemble, path, scope=)`` pairs them; Keras loads the member's values."""
    ensemble, _ = ensemble_of_two()
    ensemble.save(tmp_path / "ensemble.keras")
    lone = holding_a_model()
    for var in lone.weights:
        var.assign(RNG.normal(size=var.shape).astype("float32"))
    ws.save(tmp_path / "member.npz", tf2.export(lone))
    done = subprocess.run([sys.executable, "-m", "weightstore", "import", str(tmp_path / "member.npz"), "--into",
                           str(tmp_path / "ensemble.keras"), "--scope", "member_1", "--overwrite"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = keras.saving.load_model(tmp_path / "ensemble.keras")
    for key, value in tf2.export(lone).items():
        np.testing.assert_array_equal(tf2.export(loaded, scope="member_1")[key], value)
    lone.compile(keras.optimizers.Adam(), "mse")
    lone.optimizer.build(lone.trainable_variables)
    lone.save(tmp_path / "member.keras")  # with its optimizer's state, which the ensemble has no place for
    args = [sys.executable, "-m", "weightstore", "import", str(tmp_path / "member.keras"), "--into",
            str(tmp_path / "ensemble.keras"), "--scope", "member_1", "--overwrite"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "'member_1/optimizer/vars/0'" in done.stderr
    assert "optimizer state, which has no place there: leave it out with --exclude 'optimizer/*'" in done.stderr
    done = subprocess.run([*args, "--exclude", "optimizer/*"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_members_weights_h5_files_imported_by_scope_assign_into_the_ensemble(tmp_path):
    """``ws import member_i.weights.h5 --into ensemble.npz --scope member_i`` keeps Keras's own
    names under each scope (``member_1/layers/dense/vars/0``: a ``.weights.h5`` carries no model
    keys); the ensemble's assign of that file paired none of them ("different architectures"),
    though ``tf2.assign(ensemble, member_i.weights.h5, scope=...)`` pairs each. It pairs them by
    each member's save walk now, and the ensemble predicts as its members' sources, bit for bit."""
    sources = [holding_a_model() for _ in range(2)]
    for i, source in enumerate(sources):
        for var in source.weights:
            var.assign(RNG.normal(size=var.shape).astype("float32"))
        source.save_weights(tmp_path / f"m{i}.weights.h5")
        done = subprocess.run([sys.executable, "-m", "weightstore", "import", str(tmp_path / f"m{i}.weights.h5"),
                               "--into", str(tmp_path / "ensemble.npz"), "--scope", f"member_{i}"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    assert "member_1/layers/sequential/layers/dense/vars/0" in ws.load(tmp_path / "ensemble.npz")
    ensemble, members = ensemble_of_two()
    assert tf2.assign(ensemble, tmp_path / "ensemble.npz").ok
    for member, source in zip(members, sources, strict=True):
        np.testing.assert_array_equal(member.predict(X, verbose=0), source.predict(X, verbose=0))


def test_an_import_into_a_keras_archive_under_a_misspelt_scope_names_the_scope(tmp_path):
    """``--scope member_01`` for ``member_1``: the refusal named the tensor nearest the first key
    (another member's, as often as not), not the scope that matched nothing; the file is untouched."""
    ensemble, _ = ensemble_of_two()
    ensemble.save(tmp_path / "ensemble.keras")
    before = (tmp_path / "ensemble.keras").read_bytes()
    ws.save(tmp_path / "member.npz", tf2.export(holding_a_model()))
    done = subprocess.run([sys.executable, "-m", "weightstore", "import", str(tmp_path / "member.npz"), "--into",
                           str(tmp_path / "ensemble.keras"), "--scope", "member_01", "--overwrite"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: {tmp_path / 'ensemble.keras'}: scope 'member_01' matches no key; "
                                   "did you mean 'member_1'?")
    assert (tmp_path / "ensemble.keras").read_bytes() == before


def two_alike_out_of_order():
    """Two Dense of one shape, the second made first: only the keys tell them apart."""
    second, first = keras.layers.Dense(3), keras.layers.Dense(3)
    inputs = keras.Input((3,))
    return keras.Model(inputs, second(first(inputs)))


def an_ensemble_of(build) -> tuple:
    inputs = keras.Input((3,))
    members = [build() for _ in range(2)]
    for i, member in enumerate(members):
        member.name = f"member_{i}"
        for var in member.weights:
            var.assign(RNG.normal(size=var.shape).astype("float32"))
    return keras.Model(inputs, [member(inputs) for member in members]), members


def test_a_members_keys_numbered_by_its_ensemble_renumber_only_where_they_pair_with_every_variable():
    """A renumbering ranked from some of a member's keys is not the member's own: ``dense_3``
    alone ranks as ``dense``, which is the other Dense. A subset (``strict=False``) is assigned
    as it is keyed, never into a variable of the same shape the ranking happens to reach."""
    ensemble, members = an_ensemble_of(two_alike_out_of_order)
    part = {key.removeprefix("member_1/"): value for key, value in tf2.export(ensemble).items()
            if key.startswith("member_1/")}
    assert sorted(part) == ["dense_2/bias", "dense_2/kernel", "dense_3/bias", "dense_3/kernel"]
    lone = two_alike_out_of_order()
    assert tf2.assign(lone, part).ok  # whole: renumbered, each value where the member has it
    for key, value in tf2.export(members[1]).items():
        np.testing.assert_array_equal(tf2.export(lone)[key], value)
    subset = {key: value for key, value in part.items() if key.startswith("dense_3/")}
    lone = two_alike_out_of_order()
    before = tf2.export(lone)
    with pytest.raises(ws.AssignmentError, match="0 of 2 values share a key"):  # not renumbered: keyed as the ensemble
        tf2.assign(lone, subset, strict=False)
    for key, value in tf2.export(lone).items():
        np.testing.assert_array_equal(value, before[key])


def test_a_member_keyed_by_its_ensemble_assigns_whole_where_some_keys_also_name_other_variables(tmp_path):
    """``ws.load(ensemble.keras, scope="member_1")`` keys a member ``dense_1``, ``dense_2``; the
    member on its own has ``dense``, ``dense_1``: one key names a variable as it is (the wrong
    one), yet only the renumbering pairs every value with a variable."""
    inputs = keras.Input((3,))
    one, two = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)]), two_alike_out_of_order()
    one.name, two.name = "member_0", "member_1"
    for var in two.weights:
        var.assign(RNG.normal(size=var.shape).astype("float32"))
    keras.Model(inputs, [one(inputs), two(inputs)]).save(tmp_path / "ensemble.keras")
    values = ws.load(tmp_path / "ensemble.keras", scope="member_1")
    assert sorted(values) == ["dense_1/bias", "dense_1/kernel", "dense_2/bias", "dense_2/kernel"]
    lone = two_alike_out_of_order()
    assert tf2.assign(lone, values).ok
    for key, value in tf2.export(two).items():
        np.testing.assert_array_equal(tf2.export(lone)[key], value)


def test_an_import_by_scope_whose_keys_pair_both_as_they_are_and_renumbered_is_refused(tmp_path):
    """A member's own ``dense_1`` (its first Dense) names the ensemble's ``member_1/dense_1`` (the
    member's second) as it is and ``member_1/dense_2`` renumbered: which one is not ours to guess."""
    inputs = keras.Input((3,))
    one, two = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)]), two_alike_out_of_order()
    one.name, two.name = "member_0", "member_1"
    keras.Model(inputs, [one(inputs), two(inputs)]).save(tmp_path / "ensemble.keras")
    before = ws.load(tmp_path / "ensemble.keras")
    own = tf2.export(two_alike_out_of_order())
    ws.save(tmp_path / "part.npz", {key: value + 1 for key, value in own.items() if key.startswith("dense_1/")})
    done = subprocess.run([sys.executable, "-m", "weightstore", "import", str(tmp_path / "part.npz"), "--into",
                           str(tmp_path / "ensemble.keras"), "--scope", "member_1", "--overwrite"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "ensemble.keras" in done.stderr and "'member_1/dense_1/" in done.stderr
    assert "'member_1/dense_2/" in done.stderr
    after = ws.load(tmp_path / "ensemble.keras")
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value)


def test_one_member_exported_by_scope_has_its_own_keys_and_assigns_into_a_lone_instance():
    ensemble, members = ensemble_of_two()
    for member in members:
        for var in member.weights:
            var.assign(RNG.normal(size=var.shape).astype("float32"))
    part = tf2.export(ensemble, scope="member_1")
    assert list(part) == list(tf2.export(members[1])) == tf2.keys(holding_a_model())
    assert tf2.export(ensemble, scope="member_1", include="dense_2/*").keys() == {"dense_2/kernel", "dense_2/bias"}
    lone = holding_a_model()
    assert tf2.assign(lone, part).ok
    x = RNG.normal(size=(4, 3)).astype("float32")
    np.testing.assert_array_equal(np.asarray(lone(x)), np.asarray(ensemble(x)[1]))


# --- ws import into a Keras file: the values Keras reads, or a refusal saying what to do -----

def ws_command(*args):
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def small_dense():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head")])


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_ws_import_into_a_keras_file_replaces_what_load_weights_reads(tmp_path, suffix):
    model = small_dense()
    path = tmp_path / f"m{suffix}"
    (model.save_weights if suffix == ".weights.h5" else model.save)(path)
    names = tmp_path / "names.npz"
    assert ws_command("export", path, "-o", names).exit_code == 0
    fix = {key: value + 1 for key, value in ws.load(names).items()}
    ws.save(tmp_path / "fix.npz", fix)
    refused = ws_command("import", tmp_path / "fix.npz", "--into", path)
    assert refused.exit_code != 0 and "is a Keras file: an import replaces tensors Keras reads (2 of them); " \
                                     "pass --overwrite to replace them" in refused.output
    done = ws_command("import", tmp_path / "fix.npz", "--into", path, "--overwrite")
    assert done.exit_code == 0, done.output
    loaded = small_dense()
    loaded.load_weights(path)
    # a .keras archive is keyed like its model; a .weights.h5 by Keras's save walk, which names by class
    kernel, bias = ("head/kernel", "head/bias") if suffix == ".keras" else ("layers/dense/vars/0", "layers/dense/vars/1")
    assert sorted(fix) == sorted([kernel, bias])
    np.testing.assert_array_equal(loaded.layers[0].kernel.numpy(), fix[kernel])
    np.testing.assert_array_equal(loaded.layers[0].bias.numpy(), fix[bias])


def test_ws_import_into_a_keras_archive_takes_the_files_own_names_too(tmp_path):
    path = tmp_path / "m.keras"
    small_dense().save(path)
    ws.save(tmp_path / "fix.npz", {"layers/dense/vars/0": np.full((3, 2), 7, np.float32),
                                   "head/bias": np.full(2, 5, np.float32)})
    done = ws_command("import", tmp_path / "fix.npz", "--into", path, "--overwrite")
    assert done.exit_code == 0, done.output
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.layers[0].kernel.numpy(), np.full((3, 2), 7))
    np.testing.assert_array_equal(loaded.layers[0].bias.numpy(), np.full(2, 5))
    ws.save(tmp_path / "stray.npz", {"layers/dense/vars/7": np.zeros(2, np.float32)})
    refused = ws_command("import", tmp_path / "stray.npz", "--into", path, "--overwrite")
    text = " ".join(refused.output.split())
    assert refused.exit_code != 0
    assert (f"{path}: tensor 'layers/dense/vars/7': is a Keras file, which Keras reads by its own tensor names only "
            f"(layers/<layer>/vars/<i>, or the model keys `ws ls {path}` lists), and has no such tensor") in text
    before = path.read_bytes()
    ws.save(tmp_path / "both.npz", {"head/kernel": np.zeros((3, 2), np.float32),
                                    "layers/dense/vars/0": np.ones((3, 2), np.float32)})
    refused = ws_command("import", tmp_path / "both.npz", "--into", path, "--overwrite")
    text = " ".join(refused.output.split())
    assert refused.exit_code != 0 and path.read_bytes() == before
    assert (f"{path}: tensor 'head/kernel': the import gives this tensor twice, as 'head/kernel' and as "
            "'layers/dense/vars/0'; keep one") in text


def test_ws_import_of_model_keys_into_a_keras_file_is_refused_saying_what_to_do(tmp_path):
    model = small_dense()
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    before = path.read_bytes()
    ws.save(tmp_path / "fix.npz", {key: value + 1 for key, value in tf2.export(model).items()})
    result = ws_command("import", tmp_path / "fix.npz", "--into", path, "--overwrite")
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert (f"{path}: tensor 'head/kernel': is a Keras file, which Keras reads by its own tensor names only "
            "(layers/<layer>/vars/<i>), and has no such tensor") in text
    assert f"`ws export {path} -o names.npz` writes them" in text
    assert path.read_bytes() == before


def test_ws_import_of_a_wrong_shape_into_a_keras_file_names_both(tmp_path):
    path = tmp_path / "m.weights.h5"
    small_dense().save_weights(path)
    ws.save(tmp_path / "fix.npz", {"layers/dense/vars/0": np.zeros((2, 3), np.float32)})
    result = ws_command("import", tmp_path / "fix.npz", "--into", path, "--overwrite")
    assert result.exit_code != 0
    assert ("tensor 'layers/dense/vars/0': holds float32[3, 2]; the import gives float32[2, 3], which Keras "
            "could not load in its place") in " ".join(result.output.split())


# --- Keras's file layout given where model keys are expected --------------------------------

def bn_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="dense"),
                             keras.layers.BatchNormalization(name="bn")], name="net")


def test_a_store_in_keras_file_layout_assigns_like_the_keras_file(tmp_path):
    """``ws export x.weights.h5`` without a model writes Keras's names (``layers/dense/vars/0``):
    they pair with the model by Keras's own save walk, as the file they came from does."""
    saved = bn_model()
    path = tmp_path / "m.weights.h5"
    saved.save_weights(path)
    assert ws_command("export", path, "-o", tmp_path / "names.npz").exit_code == 0
    assert sorted(ws.load(tmp_path / "names.npz"))[0] == "layers/batch_normalization/vars/0"
    model = bn_model()
    report = tf2.assign(model, tmp_path / "names.npz")
    assert sorted(report.assigned) == sorted(tf2.keys(model))
    x = RNG.normal(size=(4, 3)).astype("float32")
    np.testing.assert_array_equal(model(x), keras_loaded(bn_model, str(path))(x))


def test_keras_layout_keys_of_another_architecture_say_so_and_pair_no_look_alikes(tmp_path):
    """Another model's Keras names: one line, before the list, says the architectures differ, and
    no hint offers a variable of another name (``gamma`` for ``beta``)."""
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.LayerNormalization(),
                              keras.layers.Dense(5)])
    path = tmp_path / "other.weights.h5"
    other.save_weights(path)
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(bn_model(), ws.load(path))
    lines = str(caught.value).splitlines()
    assert lines[1].endswith("variables: the weights and the model look like different architectures (or differ by a "
                             "scope: scope= puts the values under one, mapping={'FROM': 'TO'} renames one)")
    assert "did you mean" not in str(caught.value)


def test_a_typo_is_still_offered_its_variable():
    model = bn_model()
    values = tf2.export(model)
    values["bn/gama"] = values.pop("bn/gamma")
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(model, values)
    assert "no variable 'bn/gama'; did you mean 'bn/gamma'?" in str(caught.value)
    assert "different architectures" not in str(caught.value)


@pytest.mark.parametrize("saved_as", ["model.save", "save_weights"])
def test_a_legacy_keras_hdf5_file_says_keras_pairs_it_by_layer_order_and_how_to_load_it(tmp_path, saved_as):
    """A legacy Keras HDF5 file (``model.save("m.h5")``, and Keras 2's ``save_weights``, whose
    writer Keras 3 keeps) names tensors ``model_weights/bn/net/bn/gamma``, which Keras never pairs
    by name. The assign said the file and the model "look like different architectures"; it says
    what the file is and how to load it, and doing so gives Keras's own predictions."""
    import h5py
    from keras.src.legacy.saving import legacy_h5_format  # Keras 2's save_weights, as Keras 3 keeps it

    saved = bn_model()
    saved.compile("adam", "mse")
    saved.fit(X, X[:, :1], epochs=1, verbose=0)
    path = tmp_path / "legacy.h5"
    if saved_as == "model.save":
        saved.save(path)
    else:
        with h5py.File(path, "w") as f:
            legacy_h5_format.save_weights_to_hdf5_group(f, saved)
    model = bn_model()
    before = tf2.export(model)
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(model, path)
    assert caught.value.path == str(path)
    assert str(caught.value).startswith(f"{path}: is a legacy Keras HDF5 file (model.save('m.h5'), or Keras 2's "
                                        "save_weights), whose tensors Keras pairs with the model's layers by their order")
    assert "model.load_weights(path)" in str(caught.value)
    assert sorted(caught.value.missing) == sorted(tf2.keys(model))  # the plan's keys, for callers
    assert all(np.array_equal(value, before[key]) for key, value in tf2.export(model).items())
    model.load_weights(path)
    ws.save(tmp_path / "m.npz", tf2.export(model))
    served = bn_model()
    tf2.assign(served, tmp_path / "m.npz")
    np.testing.assert_array_equal(served(X, training=False), saved(X, training=False))
    torch = pytest.importorskip("torch")  # by layout, the same words
    from weightstore.adapters import torch as torch_adapter

    module = torch.nn.Sequential()
    module.add_module("dense", torch.nn.Linear(3, 4))
    module.add_module("bn", torch.nn.BatchNorm1d(4))
    with pytest.raises(ws.AssignmentError, match=r"is a legacy Keras HDF5 file .*model\.load_weights\(path\)"):
        torch_adapter.assign(module, path, layout="keras")
    assert torch_adapter.assign(module, tmp_path / "m.npz", layout="keras").ok


def test_a_legacy_keras_hdf5_file_whose_names_a_mapping_pairs_is_refused_naming_what_did_not_pair(tmp_path):
    """A mapping of a legacy file's names (``model_weights/bn/net/bn`` to ``bn``) pairs it, as
    Keras's own load does; one tensor short, the refusal said only that Keras pairs such a file
    by layer order, not what was missing, and ``error.missing`` was empty."""
    import h5py

    saved = bn_model()
    for var in saved.weights:
        var.assign(RNG.random(var.shape).astype("float32"))
    saved.save(tmp_path / "legacy.h5")
    rules = {"model_weights/dense/net/dense": "dense", "model_weights/bn/net/bn": "bn"}
    model = bn_model()
    assert tf2.assign(model, tmp_path / "legacy.h5", mapping=rules).ok
    np.testing.assert_array_equal(model(X, training=False),
                                  keras.models.load_model(tmp_path / "legacy.h5")(X, training=False))
    with h5py.File(tmp_path / "legacy.h5", "a") as f:
        del f["model_weights/bn/net/bn/beta"]
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(bn_model(), tmp_path / "legacy.h5", mapping=rules)
    assert caught.value.missing == ["bn/beta"] and "no value for variable 'bn/beta'" in str(caught.value)
    torch = pytest.importorskip("torch")  # by layout, as the layout names it
    from weightstore.adapters import torch as torch_adapter

    module = torch.nn.Sequential()
    module.add_module("dense", torch.nn.Linear(3, 4))
    module.add_module("bn", torch.nn.BatchNorm1d(4))
    with pytest.raises(ws.AssignmentError) as caught:
        torch_adapter.assign(module, tmp_path / "legacy.h5", layout="keras", mapping=rules)
    assert caught.value.missing == ["bn/bias"]


@pytest.mark.slow  # members trained and saved
def test_trained_keras_files_imported_by_scope_assign_into_an_ensemble_leaving_each_optimizer_out(tmp_path):
    """The ensembles job from the shell: each member's ``.keras`` (trained, so holding its Adam
    state) goes into one store by ``ws import --scope``, which puts that state under the member,
    ``model_001/optimizer/vars/0``. It was left out only at the top (``optimizer/vars/0``): the
    ensemble's assign refused 28 unexpected values, and ``ws convert --layout`` had no rule for them."""
    members = []
    for i in (1, 2):
        member = bn_model()
        member.compile(keras.optimizers.Adam(0.01), "mse")
        member.fit(X, i * X[:, :1], epochs=1, verbose=0)
        member.save(tmp_path / f"m{i}.keras")
        members.append(member)
        done = subprocess.run([sys.executable, "-m", "weightstore", "import", tmp_path / f"m{i}.keras", "--into",
                               tmp_path / "ensemble.npz", "--scope", f"model_00{i}"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert "model_001/optimizer/vars/0" in ws.load(tmp_path / "ensemble.npz")
    inputs = keras.Input((3,))
    parts = [keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="dense"),
                               keras.layers.BatchNormalization(name="bn")], name=f"model_00{i}") for i in (1, 2)]
    ensemble = keras.Model(inputs, keras.layers.Concatenate()([part(inputs) for part in parts]))
    report = tf2.assign(ensemble, tmp_path / "ensemble.npz")
    assert sorted(report.assigned) == sorted(tf2.keys(ensemble))
    assert len(report.left_out) == 2 * len(members[0].optimizer.variables)
    np.testing.assert_array_equal(ensemble(X, training=False),
                                  np.hstack([member(X, training=False) for member in members]))
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-m", "weightstore", "convert", tmp_path / "ensemble.npz",
                           tmp_path / "ensemble.safetensors", "--layout", "keras-to-torch"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(ws.load(tmp_path / "ensemble.safetensors", scope="model_002")) == [
        "bn/bias", "bn/running_mean", "bn/running_var", "bn/weight", "dense/bias", "dense/weight"]


def test_a_keras_weights_file_given_to_torch_says_it_needs_its_keras_model(tmp_path):
    torch = pytest.importorskip("torch")
    from weightstore.adapters import torch as torch_adapter

    path = tmp_path / "m.weights.h5"
    small_dense().save_weights(path)
    with pytest.raises(ws.AssignmentError) as caught:
        torch_adapter.assign(torch.nn.Linear(3, 2), str(path), layout="keras")
    assert str(caught.value) == (
        f"{path}: is a Keras weights file, whose tensors Keras names by its save walk (layers/<layer>/vars/<i>), "
        "not by layer: key it by its Keras model first, in Python with tf2.assign(model, path) then "
        f"tf2.export(model), or with `ws export {path} -o m.npz --model m.keras`")


def test_a_keras_archive_keeping_its_own_names_given_to_torch_says_why(tmp_path):
    """Only a .keras whose config the table cannot key is refused, and the message says which layer."""
    torch = pytest.importorskip("torch")
    from weightstore.adapters import torch as torch_adapter

    path = tmp_path / "m.keras"
    keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head"), Scaled(name="scale")]).save(path)
    with pytest.raises(ws.AssignmentError) as caught:
        torch_adapter.assign(torch.nn.Linear(3, 2), str(path), layout="keras")
    assert str(caught.value) == (
        f"{path}: is a .keras archive that keeps Keras's own tensor names (layers/<layer>/vars/<i>), not its "
        "model's, as its layer 'scale' is a 'Scaled' from 'test_keras_models', not one of Keras's built-in layers: "
        "key it by its Keras model first, in Python with tf2.assign(model, path) then tf2.export(model), or with "
        f"`ws export {path} -o m.npz --model-keys`")


def test_a_keras_archive_pairs_with_a_tf1_graph_of_its_layer_names(tmp_path):
    """A .keras read on its own is keyed like its model (head/kernel, head/bias), as a store
    tf2.export wrote is: a TF1 graph of the same layers takes it and computes what Keras does.
    A .weights.h5 keeps Keras's save-walk names, which no graph has, and is refused saying so."""
    from weightstore.adapters import tf1

    model = small_dense()
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    x = RNG.normal(size=(4, 3)).astype("float32")
    expected = np.asarray(model(x))
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        with tf.compat.v1.variable_scope("head"):
            kernel, bias = tf.compat.v1.get_variable("kernel", (3, 2)), tf.compat.v1.get_variable("bias", (2,))
        sess.run(tf.compat.v1.global_variables_initializer())
        report = tf1.assign(sess, str(tmp_path / "m.keras"))
        assert sorted(report.assigned) == ["head/bias", "head/kernel"]
        np.testing.assert_allclose(sess.run(tf.matmul(x, kernel) + bias), expected, atol=1e-6)
        with pytest.raises(ws.AssignmentError) as caught:
            tf1.assign(sess, str(tmp_path / "m.weights.h5"))
    assert str(caught.value).startswith(f"{tmp_path / 'm.weights.h5'}: is a Keras weights file, whose tensors Keras "
                                        "names by its save walk")
    assert "different architectures" not in str(caught.value)



def test_a_trained_models_keras_archive_goes_into_torch_flax_and_tf1_without_its_optimizer_state(tmp_path):
    """A compiled model's .keras holds its optimizer's state (optimizer/vars/<i>), which no
    module or graph has a variable for: every adapter leaves it out, as tf2.assign does, and
    lists it in report.left_out, rather than refusing the file a user trained and saved."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("flax.nnx")
    from flax import nnx

    from weightstore.adapters import flax as flax_adapter
    from weightstore.adapters import tf1
    from weightstore.adapters import torch as torch_adapter

    model = small_dense()
    model.compile(keras.optimizers.Adam(0.1), "mse")
    model.fit(X, X[:, :2], epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    expected = np.asarray(model(X))
    state = [key for key in ws.load(path) if key.startswith("optimizer/")]
    assert state  # the step counter, the learning rate, Adam's moments

    module = torch.nn.ModuleDict({"head": torch.nn.Linear(3, 2)})
    report = torch_adapter.assign(module, path, layout="keras")
    assert sorted(report.assigned) == ["head/bias", "head/weight"] and sorted(report.left_out) == sorted(state)
    with torch.no_grad():
        np.testing.assert_allclose(module["head"](torch.from_numpy(X)).numpy(), expected, atol=1e-5)

    class Head(nnx.Module):
        def __init__(self):
            self.head = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    flax_module = Head()
    report = flax_adapter.assign(flax_module, path, layout="keras")
    assert sorted(report.left_out) == sorted(state)
    np.testing.assert_allclose(np.asarray(flax_module.head(X)), expected, atol=1e-5)

    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        with tf.compat.v1.variable_scope("head"):
            kernel, bias = tf.compat.v1.get_variable("kernel", (3, 2)), tf.compat.v1.get_variable("bias", (2,))
        sess.run(tf.compat.v1.global_variables_initializer())
        report = tf1.assign(sess, path)
        assert sorted(report.assigned) == ["head/bias", "head/kernel"] and sorted(report.left_out) == sorted(state)
        np.testing.assert_allclose(sess.run(tf.matmul(X, kernel) + bias), expected, atol=1e-5)

class ListHeld(keras.Model):
    """Layers in a plain Python list: Keras tracks them, TF's checkpoint walk does not."""

    def __init__(self):
        super().__init__()
        self.blocks = [keras.layers.Dense(3), keras.layers.Dense(2)]
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_layers_in_a_python_list_are_missing_from_a_tf2_checkpoint_and_the_message_says_why(tmp_path):
    model = ListHeld()
    model(X[:1])
    prefix = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    fresh = ListHeld()
    fresh(X[:1])
    with pytest.raises(ws.AssignmentError) as caught:
        tf2.assign(fresh, prefix)
    assert "  4 missing (variables with no value):" in str(caught.value)
    assert ("  why: 4 of the model's variables ('dense/kernel', …) are held where TF's checkpoint walk never looks "
            "(layers in a plain Python list or dict attribute of a subclassed model: Keras tracks them, "
            "tf.train.Checkpoint does not), so no TF2 checkpoint of this model has a node for them; save it with "
            "model.save_weights, whose file holds them, or keep those layers in attributes of their own"
            ) in str(caught.value)


# --- LoRA: a Keras file holds the merged kernel, its loader zeroes the factors ---------------

def lora_model(enabled: bool = True):
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(10, 6, name="embed")(inputs)
    x = keras.layers.Conv1D(5, 2, name="conv")(x)
    x = keras.layers.EinsumDense("abc,cd->abd", output_shape=(3, 3), name="einsum")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(keras.layers.Flatten()(x)))
    if enabled:
        for name in ("embed", "conv", "einsum", "head"):
            model.get_layer(name).enable_lora(2)
    return model


@pytest.mark.filterwarnings("error::weightstore.adapters.plan.AssignWarning")  # the factors are no file's
@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_a_lora_models_keras_file_assigns_as_load_weights_restores_it(suffix, tmp_path):
    """The file holds each LoRA layer's merged kernel (a tensor computed when saved) and no
    factors: it was refused as 'unexpected' and 'missing'. Keras's loader writes the merged
    kernel and zeroes the factors; so does an assign, and the predictions are the same."""
    tokens = np.random.default_rng(0).integers(0, 10, (3, 4))
    saved = lora_model()
    for var in saved.weights:  # factors that add something, as after fine-tuning
        var.assign(np.random.default_rng(len(var.path)).normal(size=var.shape).astype("float32"))
    path = str(tmp_path / f"m{suffix}")
    saved.save(path) if suffix == ".keras" else saved.save_weights(path)
    expected = keras_loaded(lora_model, path)
    for target in (lora_model(), lora_model(enabled=False)):
        assert tf2.assign(target, path).ok
        np.testing.assert_allclose(target(tokens), saved(tokens), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(target(tokens), expected(tokens))
    assigned = lora_model()
    tf2.assign(assigned, path)
    factors = {key: value for key, value in tf2.export(assigned).items() if "/lora_" in key}
    assert len(factors) == 8 and not any(value.any() for value in factors.values())  # as load_weights leaves them
    keyed_as_the_file = tmp_path / "keyed.npz"  # what `ws export m.weights.h5` writes without a model
    ws.save(keyed_as_the_file, ws.load(path))
    from_keyed = lora_model()
    assert tf2.assign(from_keyed, keyed_as_the_file).ok
    np.testing.assert_array_equal(from_keyed(tokens), expected(tokens))
    ws.save(tmp_path / "m.npz", tf2.export(saved))  # an export holds the factors: they travel as they are
    via_npz = lora_model()
    tf2.assign(via_npz, tmp_path / "m.npz")
    np.testing.assert_array_equal(via_npz(tokens), saved(tokens))


def lora_member(name: str, quantized: bool = False):
    member = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")], name=name)
    if quantized:
        member.quantize("int8")
    member.get_layer("d").enable_lora(2)
    return member


def randomized(model):
    for var in model.weights:
        if var.dtype.startswith("float"):
            var.assign(np.random.default_rng(len(var.path)).normal(size=var.shape).astype(var.dtype))
    return model


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")  # Keras's own
def test_lora_keras_files_of_ensembles_and_quantized_layers_and_what_an_assign_keeps(tmp_path):
    """Layers named alike in each member of an ensemble (the merged kernel was paired by layer
    name), a quantized layer's merged scale, factors an assign leaves out, and hot reload's
    memory of factors the Keras file zeroed."""
    x = np.random.default_rng(0).normal(size=(2, 8)).astype("float32")

    def ensemble():
        inputs = keras.Input((8,))
        return keras.Model(inputs, [lora_member(f"model_00{i}")(inputs) for i in (1, 2)])

    for build in (ensemble, lambda: lora_member("q", quantized=True)):
        path = str(tmp_path / "m.weights.h5")
        randomized(build()).save_weights(path)
        expected, assigned = keras_loaded(build, path), build()
        assert tf2.assign(assigned, path).ok
        for got, want in zip(keras.tree.flatten(assigned(x)), keras.tree.flatten(expected(x)), strict=True):
            np.testing.assert_array_equal(got, want)
    path = str(tmp_path / "plain.weights.h5")  # a base model's file, into an adapter-tuned model
    keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")], name="m").save_weights(path)
    tuned = randomized(lora_member("m"))
    kept = {key: value for key, value in tf2.export(tuned).items() if "lora_" in key}
    report = tf2.assign(tuned, path, exclude="d/lora_*")
    assert sorted(report.assigned) == ["d/bias", "d/kernel"]  # the adapter's factors left as they are
    assert all(np.array_equal(tf2.export(tuned)[key], value) for key, value in kept.items())
    ws.publish(tmp_path / "run", tf2.export(randomized(lora_member("m"))), step=1)
    follower_side = lora_member("m")
    version = ws.latest(tmp_path / "run")
    tf2.assign(follower_side, version)
    assert "d/lora_kernel_a" in tf2.assign(follower_side, path).assigned  # zeroed, as load_weights does
    again = tf2.assign(follower_side, version)  # the factors' memory was forgotten: written again
    assert {"d/lora_kernel_a", "d/lora_kernel_b"} <= set(again.assigned)
    np.testing.assert_array_equal(follower_side(x), randomized(lora_member("m"))(x))


# --- a .keras archive read on its own: keyed as tf2.export keys its model -------------------

def _sequential_dense_bn():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
                             keras.layers.Dense(2, use_bias=False), keras.layers.BatchNormalization(center=False)])


def _functional_with_nested_model():
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.LayerNormalization()])
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(1)(inner(keras.layers.Dense(3)(inputs))))


def _small_cnn():
    layers = keras.layers
    return keras.Sequential([keras.Input((8, 8, 3)), layers.Conv2D(4, 3), layers.BatchNormalization(),
                             layers.DepthwiseConv2D(3), layers.SeparableConv2D(4, 1), layers.Conv2DTranspose(2, 2),
                             layers.GroupNormalization(2), layers.MaxPooling2D(), layers.Flatten(), layers.Dense(2)])


def _recurrent():
    layers = keras.layers
    return keras.Sequential([keras.Input((5,)), layers.Embedding(10, 4), layers.LSTM(3, return_sequences=True),
                             layers.Bidirectional(layers.GRU(2, return_sequences=True)), layers.SimpleRNN(2)])


def _attention_block():
    inputs = keras.Input((5, 4))
    attended = keras.layers.MultiHeadAttention(2, 3)(inputs, inputs)
    normed = keras.layers.LayerNormalization()(keras.layers.Add()([inputs, attended]))
    return keras.Model(inputs, keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 4), bias_axes="d")(normed))


def _adapted_normalization():
    return normalized(RNG.normal(5, 3, (16, 3)).astype("float32"))  # its statistics are variables


@pytest.mark.parametrize("build", [_sequential_dense_bn, _functional_with_nested_model, _small_cnn, _recurrent,
                                   _attention_block, _adapted_normalization])
def test_a_keras_archive_opens_keyed_as_tf2_exports_its_model(tmp_path, build):
    build()  # a model built before: Keras's counter names the next one's layers dense_3…, which export renumbers
    model = build()
    model.save(tmp_path / "m.keras")
    exported = tf2.export(model)
    with ws.open(tmp_path / "m.keras") as store:
        assert store.keys() == list(exported)
        for key, value in exported.items():
            np.testing.assert_array_equal(store[key], value)
    assert not ws.load(tmp_path / "m.keras").keys() - exported.keys()


def test_a_keras_archive_of_a_compiled_model_keeps_its_optimizer_state_under_keras_names(tmp_path):
    model = _sequential_dense_bn()
    model.compile("adam", "mse")
    model.fit(np.zeros((4, 4), np.float32), np.zeros((4, 2), np.float32), verbose=0)
    model.save(tmp_path / "m.keras")
    with_state = tf2.export(model, optimizer=True)
    with ws.open(tmp_path / "m.keras") as store:
        assert store.keys() == list(with_state)
        np.testing.assert_array_equal(store["optimizer/vars/1"], with_state["optimizer/vars/1"])


@keras.saving.register_keras_serializable(package="weightstore_tests")
class Scaled(keras.layers.Layer):
    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, inputs):
        return inputs * self.scale


def test_a_keras_archive_with_a_custom_layer_keeps_its_own_names_whole_and_ls_says_why(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head"), Scaled()])
    model.save(tmp_path / "m.keras")
    with ws.open(tmp_path / "m.keras") as store:
        assert store.keys() == ["layers/dense/vars/0", "layers/dense/vars/1", "layers/scaled/vars/0"]
    listed = ws_command("ls", tmp_path / "m.keras")
    assert listed.exit_code == 0, listed.output
    text = " ".join(listed.output.split())
    why = "its layer 'scaled' is a 'Scaled' from 'test_keras_models', not one of Keras's built-in layers"
    assert f"keys are the file's own names, not its model's: {why}" in text
    # a ws process cannot import a user's class: the note names the way that works besides --model-keys
    assert ("(ws export --model-keys builds the model in Keras to key them, of Keras's and keras-hub's layers; "
            "a class of your own: tf2.load(model, path) in Python)") in text
    assert json.loads(ws_command("ls", tmp_path / "m.keras", "--json").stdout)["keys_note"] == why
    small_dense().save(tmp_path / "keyed.keras")
    assert json.loads(ws_command("ls", tmp_path / "keyed.keras", "--json").stdout)["keys_note"] == ""
    keyed = tmp_path / "keyed.npz"  # --model-keys builds the model, custom class and all, in Keras's safe mode
    assert ws_command("export", tmp_path / "m.keras", "-o", keyed, "--model-keys").exit_code == 0
    assert sorted(ws.load(keyed)) == ["head/bias", "head/kernel", "scaled/variable"]


def test_a_keras_archive_with_a_layer_class_of_a_script_says_so_not_from_none(tmp_path):
    """A class defined in the script that saved the model (its module ``__main__``, which Keras
    writes as null): the note said it was "from None"."""
    in_script = type("InScript", (Scaled,), {"__module__": "__main__"})
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head"), in_script(name="mine")])
    model.save(tmp_path / "m.keras")
    listed = ws_command("ls", tmp_path / "m.keras", "--json")
    assert json.loads(listed.stdout)["keys_note"] == (
        "its layer 'mine' is a 'InScript' defined in a script (__main__), not one of Keras's built-in layers")


def test_a_keras_archive_on_s3_opens_as_a_local_one_and_tf2_assign_pairs_it_by_its_own_names(tmp_path, s3):
    """A remote .keras was opened as a zip of arrays (an npz) and failed; it opens as a local one
    does, and tf2.assign pairs it by its own names, as a local one, so a custom layer class, which
    its config cannot key, is fine."""
    import s3fs

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head"), Scaled()])
    model.layers[-1].scale.assign([2.0, -3.0])
    model.save(tmp_path / "m.keras")
    s3fs.S3FileSystem().put(str(tmp_path / "m.keras"), f"{BUCKET}/m.keras")
    fresh = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head"), Scaled()])
    report = tf2.assign(fresh, f"s3://{BUCKET}/m.keras")
    assert report.ok and not report.unexpected and not report.left_out
    reference = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head"), Scaled()])
    reference.load_weights(tmp_path / "m.keras")  # Keras's own, of the same file
    np.testing.assert_array_equal(np.asarray(fresh(X)), np.asarray(reference(X)))
    with ws.open(f"s3://{BUCKET}/m.keras") as remote, ws.open(tmp_path / "m.keras") as local:  # not an npz
        assert remote.keys() == local.keys() and remote.format == local.format == "keras"
        for key in local:
            np.testing.assert_array_equal(remote[key], local[key])
    with open(tmp_path / "m.keras", "rb") as whole:
        s3fs.S3FileSystem().pipe(f"{BUCKET}/cut.keras", whole.read()[:-100])  # its zip directory cut off
    with pytest.raises(ws.FormatError) as cut:
        tf2.assign(fresh, f"s3://{BUCKET}/cut.keras")
    assert cut.value.path == f"s3://{BUCKET}/cut.keras"  # the URL, not the copy it was read from
    with pytest.raises(ws.StoreNotFoundError) as missing:
        tf2.assign(fresh, f"s3://{BUCKET}/missing.keras")
    assert missing.value.path == f"s3://{BUCKET}/missing.keras"


@pytest.mark.parametrize("build", [_recurrent, _attention_block])
def test_tf2_assign_of_a_keras_archive_predicts_as_load_model(tmp_path, build):
    model = build()
    model.save(tmp_path / "m.keras")
    inputs = (np.arange(10).reshape(2, 5) % 10 if build is _recurrent
              else RNG.normal(size=(2, 5, 4))).astype("float32")
    fresh = build()
    tf2.assign(fresh, str(tmp_path / "m.keras"))
    np.testing.assert_array_equal(fresh(inputs), keras.models.load_model(tmp_path / "m.keras")(inputs))


def test_a_quantized_models_keras_archive_keeps_its_own_names_and_says_why(tmp_path):
    """Keras 3.15 writes a quantized layer's policy as ``{"mode", "source_name"}``, no name: the
    table, which keys no int8 scale, leaves the file whole for the quantization, not by luck."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="head")])
    model.quantize("int8")
    model.save(tmp_path / "m.keras")
    with ws.open(tmp_path / "m.keras") as store:
        assert all(key.startswith("layers/dense/vars/") for key in store)
        assert store._reader.keys_note == "its layer 'head' is quantized or LoRA-enabled, which the table does not know"
