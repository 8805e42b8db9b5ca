"""The TF1 adapter against real ``tf.compat.v1`` graphs: every test builds its own graph.

Eager execution stays on for the process (TF2 tests share it); graphs are entered with
``tf.Graph().as_default()`` instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import warnings
import weakref

import ml_dtypes
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import weightstore as ws  # noqa: E402
from weightstore.adapters import _tf1_callables, skeleton, tf1  # noqa: E402
from weightstore.adapters._values import Values  # noqa: E402
from weightstore.adapters.plan import AssignWarning  # noqa: E402
from weightstore.core._gcpause import paused_gc  # noqa: E402
from weightstore.errors import AssignmentError, ChecksumError, FormatError, SelectionError  # noqa: E402
from weightstore.io import _local  # noqa: E402
from weightstore.sync import Version  # noqa: E402

v1 = tf.compat.v1
DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
          "complex64"]
SHAPES = {"scalar": [], "empty": [0, 3], "matrix": [3, 4]}


@contextlib.contextmanager
def graph_session():
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as sess:
        yield graph, sess


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def random_array(dtype: np.dtype, shape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return rng.random(shape) > 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def values(sess, variables) -> list[np.ndarray]:
    return [np.asarray(x) for x in sess.run(list(variables))]


def build_dtype_graph(dtype_name: str):
    """Resource and ref variables of one dtype and three shapes, initialised to zeros."""
    dtype = tf.as_dtype(dtype_name)
    made = []
    for kind, resource in (("res", True), ("ref", False)):
        for label, shape in SHAPES.items():
            made.append(v1.get_variable(f"{kind}/{label}", shape, dtype=dtype,
                                        initializer=v1.zeros_initializer(), use_resource=resource))
    return made


@pytest.mark.parametrize("route", ["dict", "npz", "h5"])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_round_trip_every_dtype(tmp_path, dtype_name, route):
    dtype = np_dtype(dtype_name)
    names = [f"{kind}/{label}" for kind in ("res", "ref") for label in SHAPES]
    expected = {name: random_array(dtype, SHAPES[name.split("/")[1]], seed=i) for i, name in enumerate(names)}
    with graph_session() as (_, sess):
        build_dtype_graph(dtype_name)
        sess.run(v1.global_variables_initializer())
        tf1.assign(sess, expected)
        exported = tf1.export(sess)
    assert list(exported) == list(expected)
    source = exported
    if route != "dict":
        source = tmp_path / f"w.{route}"
        ws.save(source, exported)
    with graph_session() as (_, sess):
        variables = build_dtype_graph(dtype_name)
        report = tf1.assign(sess, source)  # into uninitialised variables: assign is an initialiser
        assert report.assigned == list(expected) and report.ok
        for variable, got in zip(variables, values(sess, variables), strict=True):
            want = expected[variable.op.name]
            assert got.dtype == dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_keys_have_no_output_suffix_and_cover_every_collection():
    with graph_session() as (_, sess):
        v1.get_variable("global", [2])
        v1.get_variable("local", [2], collections=[v1.GraphKeys.LOCAL_VARIABLES])
        v1.get_variable("model", [2], collections=[v1.GraphKeys.MODEL_VARIABLES])
        v1.Variable(np.ones(2, np.float32), name="custom", collections=["my_collection"], use_resource=False)
        v1.Variable("text", name="words")  # a string variable holds no weights
        sess.run([v.initializer for name in (v1.GraphKeys.GLOBAL_VARIABLES, v1.GraphKeys.LOCAL_VARIABLES,
                                             v1.GraphKeys.MODEL_VARIABLES, "my_collection")
                  for v in v1.get_collection(name)])
        assert sorted(tf1.export(sess)) == ["custom", "global", "local", "model"]


def test_scope_matches_whole_segments():
    with graph_session() as (_, sess):
        one = v1.get_variable("model_1/w", [2], initializer=v1.zeros_initializer())
        ten = v1.get_variable("model_10/w", [2], initializer=v1.zeros_initializer())
        sess.run(v1.global_variables_initializer())
        assert list(tf1.export(sess, scope="model_1")) == ["w"]
        report = tf1.assign(sess, {"w": np.ones(2, np.float32)}, scope="model_1")
        assert report.assigned == ["model_1/w"]
        one_value, ten_value = values(sess, [one, ten])
        np.testing.assert_array_equal(one_value, [1, 1])
        np.testing.assert_array_equal(ten_value, [0, 0])
        with pytest.raises(SelectionError, match="model_1"):
            tf1.export(sess, scope="model_100")


def test_mapping_then_scope_then_selection():
    with graph_session() as (_, sess):
        student = v1.get_variable("ens/student/dense/w", [2], initializer=v1.zeros_initializer())
        other = v1.get_variable("ens/student/head/w", [2], initializer=v1.zeros_initializer())
        sess.run(v1.global_variables_initializer())
        weights = {"teacher/dense/w": np.full(2, 3, np.float32), "teacher/head/w": np.full(2, 4, np.float32)}
        report = tf1.assign(sess, weights, scope="ens", mapping=["teacher=student"], include="student/dense")
        assert report.assigned == ["ens/student/dense/w"]
        np.testing.assert_array_equal(values(sess, [student, other]), [[3, 3], [0, 0]])
        tf1.assign(sess, weights, mapping={"teacher": "ens/student"})
        np.testing.assert_array_equal(values(sess, [student, other]), [[3, 3], [4, 4]])
        assert list(tf1.export(sess, scope="ens", include="*/head/*")) == ["student/head/w"]
        assert list(tf1.export(sess, exclude="ens/student/head")) == ["ens/student/dense/w"]


def test_strict_lists_every_problem_and_changes_nothing():
    with graph_session() as (_, sess):
        w = v1.get_variable("model_001/w", [3], initializer=v1.zeros_initializer())
        b = v1.get_variable("model_001/b", [3], initializer=v1.zeros_initializer())
        k = v1.get_variable("model_001/k", [2, 2], initializer=v1.zeros_initializer())
        sess.run(v1.global_variables_initializer())
        weights = {
            "model_02/w": np.ones(3, np.float32),          # unexpected, close to model_001/w
            "model_001/b": np.ones(3, np.float32),         # fine on its own
            "model_001/k": np.ones((4,), np.float32),      # mismatched shape
        }
        with pytest.raises(AssignmentError) as caught:
            tf1.assign(sess, weights)
        error = caught.value
        assert error.missing == ["model_001/w"]
        assert error.unexpected == ["model_02/w"]
        assert [m.key for m in error.mismatched] == ["model_001/k"]
        text = str(error)
        assert "nothing was changed" in text
        assert "no variable 'model_02/w'; did you mean 'model_001/w'?" in text
        assert "shapes differ" in text
        for got in values(sess, [w, b, k]):
            assert not got.any()

        with pytest.raises(AssignmentError, match="no variable 'model_01/w'; did you mean 'model_001/w'"):
            tf1.assign(sess, {"w": np.ones(3, np.float32)}, scope="model_01")

        with pytest.warns(AssignWarning, match=r"the weight dictionary \(strict=False\) left 2 of 3 variables as "
                                               r"they were; 1 of 3 values fit a variable \(2 share a key with one\)") as warned:
            report = tf1.assign(sess, weights, strict=False)
        assert [w.filename for w in warned] == [__file__]  # pointing at the call, not inside weightstore
        assert report.assigned == ["model_001/b"]
        assert report.missing == ["model_001/w"] and report.unexpected == ["model_02/w"]
        assert [m.key for m in report.mismatched] == ["model_001/k"]
        np.testing.assert_array_equal(values(sess, [w, b]), [[0, 0, 0], [1, 1, 1]])


@pytest.mark.parametrize("saved_under, graph_under", [("model_002/tower_0", ""), ("", "model_002")])
def test_keys_one_scope_apart_name_the_scope_or_mapping_that_pairs_them(tmp_path, saved_under, graph_under):
    """Saved under one scope and assigned unscoped (or the reverse): the error names the exact
    ``mapping=`` or ``scope=`` to pass, and passing it assigns every variable."""
    def under(scope: str, key: str) -> str:
        return f"{scope}/{key}" if scope else key

    names = ["dense/kernel", "dense/bias", "head/kernel"]
    ws.save(tmp_path / "m.npz", {under(saved_under, k): np.full(3, i, np.float32) for i, k in enumerate(names)})
    with graph_session() as (_, sess):
        variables = [v1.get_variable(under(graph_under, k), [3], initializer=v1.zeros_initializer()) for k in names]
        sess.run(v1.global_variables_initializer())
        fix = ({"mapping": {saved_under: ""}} if saved_under else {"scope": graph_under})
        said = (f"pass mapping={{{saved_under!r}: ''}}" if saved_under else f"pass scope={graph_under!r}")
        with pytest.raises(AssignmentError, match="the keys differ by a scope: ") as caught:
            tf1.assign(sess, tmp_path / "m.npz")
        assert said in str(caught.value) and "different architectures" not in str(caught.value)
        with pytest.warns(AssignWarning, match=re.escape(said)):
            tf1.assign(sess, {**ws.load(tmp_path / "m.npz"), under(graph_under, "head/kernel"): np.ones(3, np.float32)},
                       strict=False)
        report = tf1.assign(sess, tmp_path / "m.npz", **fix)
        assert sorted(report.assigned) == sorted(under(graph_under, k) for k in names)
        np.testing.assert_array_equal(values(sess, variables), [[0] * 3, [1] * 3, [2] * 3])


def test_an_ensemble_graph_given_an_unscoped_file_without_scope_names_the_scopes_that_pair_it(tmp_path):
    """The ensembles job without its ``scope=``: three members of one architecture, and a member's
    unscoped file pairs under each of them. It said the file and the graph "look like different
    architectures", as no one scope held half of the graph's variables."""
    names = ["dense/kernel", "dense/bias", "head/kernel"]
    ws.save(tmp_path / "m.npz", {k: np.full(3, i, np.float32) for i, k in enumerate(names)})
    with graph_session() as (_, sess):
        for member in ("model_001", "model_002", "model_003"):
            for k in names:
                v1.get_variable(f"{member}/{k}", [3], initializer=v1.zeros_initializer())
        sess.run(v1.global_variables_initializer())
        with pytest.raises(AssignmentError, match="the keys differ by a scope: ") as caught:
            tf1.assign(sess, tmp_path / "m.npz")
        assert ("the variables are under 'model_001', 'model_002' and 'model_003' and the values are not: pass "
                "scope='model_001' (or another of them)") in str(caught.value)
        assert "different architectures" not in str(caught.value)
        assert sorted(tf1.assign(sess, tmp_path / "m.npz", scope="model_002").assigned) == [
            f"model_002/{k}" for k in sorted(names)]
        for member in range(4, 41):  # forty members: three named, the rest counted
            for k in names:
                v1.get_variable(f"model_{member:03d}/{k}", [3], initializer=v1.zeros_initializer())
        with pytest.raises(AssignmentError, match="the keys differ by a scope: ") as caught:
            tf1.assign(sess, tmp_path / "m.npz")
        assert "under 'model_001', 'model_002', 'model_003' and 37 more and the values are not" in str(caught.value)


def test_an_ensemble_file_into_one_member_graph_names_its_scopes_and_how_to_take_one_out(tmp_path):
    """The other way: an ensemble's file (three members under ``model_00N/``) assigned into a lone
    member's graph. It said the two "look like different architectures", as no one scope held half
    of the file's values; each member's scope pairs every variable, and loading one by scope
    assigns it."""
    names = ["dense/kernel", "dense/bias", "head/kernel"]
    ws.save(tmp_path / "ensemble.npz", {f"model_00{m}/{k}": np.full(3, 10 * m + i, np.float32)
                                        for m in (1, 2, 3) for i, k in enumerate(names)})
    with graph_session() as (_, sess):
        variables = [v1.get_variable(k, [3], initializer=v1.zeros_initializer()) for k in names]
        sess.run(v1.global_variables_initializer())
        with pytest.raises(AssignmentError, match="the keys differ by a scope: ") as caught:
            tf1.assign(sess, tmp_path / "ensemble.npz")
        assert ("the values are under 'model_001', 'model_002' and 'model_003' (an ensemble, each holding the "
                "variables' keys) and the variables are not: assign one of them, ws.load(path, scope='model_001')"
                ) in str(caught.value)
        assert "different architectures" not in str(caught.value)
        np.testing.assert_array_equal(values(sess, variables), [[0] * 3] * 3)
        tf1.assign(sess, ws.load(tmp_path / "ensemble.npz", scope="model_002"))
        np.testing.assert_array_equal(values(sess, variables), [[20] * 3, [21] * 3, [22] * 3])


def test_a_wrong_scope_given_is_what_the_message_says_to_change():
    """Values put under ``model_001/`` by the caller's own ``scope=`` are not fixed by a mapping
    (it applies before the scope): the message names scope= and mapping= as the thing to change."""
    with graph_session() as (_, sess):
        for key in ("dense/kernel", "dense/bias", "model_001/head/kernel", "model_001/head/bias"):
            v1.get_variable(key, [3], initializer=v1.zeros_initializer())
        sess.run(v1.global_variables_initializer())
        values = {"dense/kernel": np.ones(3, np.float32), "dense/bias": np.ones(3, np.float32)}
        with pytest.raises(AssignmentError) as caught:
            tf1.assign(sess, values, scope="model_001")
        assert ("the values are under 'model_001' and the variables are not: change scope= or mapping=, which put "
                "them there") in str(caught.value)
        assert "pass mapping" not in str(caught.value)


def test_cast_rules():
    with graph_session() as (_, sess):
        w = v1.get_variable("w", [2], dtype=tf.float32, initializer=v1.zeros_initializer())
        sess.run(w.initializer)
        tf1.assign(sess, {"w": np.array([0.5, 1.5], np.float16)})  # widening is always fine
        np.testing.assert_array_equal(sess.run(w), [0.5, 1.5])
        for value in (np.array([1.0, 2.0], np.float64), np.array([1, 2], np.int64)):
            with pytest.raises(AssignmentError, match="cast=True"):
                tf1.assign(sess, {"w": value})
            np.testing.assert_array_equal(sess.run(w), [0.5, 1.5])
        tf1.assign(sess, {"w": np.array([1.25, 2.0], np.float64)}, cast=True)
        np.testing.assert_array_equal(sess.run(w), [1.25, 2.0])


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_cast_refuses_values_out_of_the_variables_range(tmp_path, resource):
    """cast=True rounds; a value the dtype cannot hold (inf after the cast, an int wrapped
    around) is refused in the verify pass, from a file, and no variable changes."""
    with graph_session() as (_, sess):
        with v1.variable_scope("", use_resource=resource):
            a = v1.get_variable("a", [2], dtype=tf.float32, initializer=v1.zeros_initializer())
            small = v1.get_variable("small", [2], dtype=tf.int8, initializer=v1.zeros_initializer())
        sess.run([a.initializer, small.initializer])
        for bad, match in (({"a": np.array([1.0, 1e300]), "small": np.array([1, 2])}, r"'a'.*1e\+300, beyond float32"),
                           ({"a": np.array([1.0, 2.0]), "small": np.array([1, 300])}, "'small'.*300, beyond int8")):
            path = tmp_path / "bad.npz"
            ws.save(path, bad)
            with pytest.raises(AssignmentError, match=match) as caught:
                tf1.assign(sess, path, cast=True)
            assert caught.value.path == str(path)
            assert [v.tolist() for v in values(sess, [a, small])] == [[0, 0], [0, 0]]
        tf1.assign(sess, {"a": np.array([1.0, 1e-300]), "small": np.array([-128, 127])}, cast=True)  # rounding is fine
        assert [v.tolist() for v in values(sess, [a, small])] == [[1, 0], [-128, 127]]
        with warnings.catch_warnings(record=True) as caught_warnings:  # refused: no "left 1 of 2 as they were"
            warnings.simplefilter("always")
            with pytest.raises(AssignmentError, match=r"cannot assign 'a' as float32: the value holds 1e\+300"):
                tf1.assign(sess, {"a": np.array([1e300, 0.0])}, cast=True, strict=False)
        assert caught_warnings == []


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("axis", [0, 1])
def test_partitioned_variables_are_whole_tensors(tmp_path, resource, axis):
    whole = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
    with graph_session() as (_, sess):
        part = v1.get_variable("net/w", [7, 5], partitioner=v1.fixed_size_partitioner(3, axis=axis),
                               use_resource=resource)
        sess.run(v1.global_variables_initializer())
        parts = list(part)
        assert [p.op.name for p in parts] == ["net/w/part_0", "net/w/part_1", "net/w/part_2"]
        tf1.assign(sess, {"net/w": whole})
        np.testing.assert_array_equal(np.concatenate(values(sess, parts), axis=axis), whole)
        exported = tf1.export(sess)
        assert list(exported) == ["net/w"]
        np.testing.assert_array_equal(exported["net/w"], whole)
        ws.save(tmp_path / "w.h5", exported)
    with graph_session() as (_, sess):
        part = v1.get_variable("model_2/net/w", [7, 5], partitioner=v1.fixed_size_partitioner(3, axis=axis),
                               use_resource=resource)
        report = tf1.assign(sess, tmp_path / "w.h5", scope="model_2")
        assert report.assigned == ["model_2/net/w"]
        np.testing.assert_array_equal(np.concatenate(values(sess, list(part)), axis=axis), whole)


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_a_variable_of_no_static_shape_exports_and_assigns_as_its_value_is(tmp_path, resource):
    """``validate_shape=False`` leaves a variable's shape unknown to the graph: it must not break
    the export and assign of every other variable; it goes out with its value's shape, and takes
    a value of that shape back (another shape is refused, changing nothing)."""
    with graph_session() as (graph, sess):
        with v1.variable_scope("", use_resource=resource):
            v1.get_variable("a", [2], initializer=v1.zeros_initializer())
        fed = v1.placeholder(tf.float32, [None, 3])
        dyn = v1.Variable(fed, validate_shape=False, name="dyn", use_resource=resource)
        assert tf1.assign(sess, {"a": np.ones(2, np.float32)}).assigned == ["a"]  # dyn holds no value yet
        sess.run(dyn.initializer, {fed: np.ones((4, 3), np.float32)})
        exported = tf1.export(sess)
        assert {key: value.shape for key, value in exported.items()} == {"a": (2,), "dyn": (4, 3)}
        ws.save(tmp_path / "m.npz", {"a": np.full(2, 3, np.float32), "dyn": np.full((4, 3), 5, np.float32)})
        assert sorted(tf1.assign(sess, tmp_path / "m.npz").assigned) == ["a", "dyn"]
        with pytest.raises(AssignmentError, match=r"dyn: variable is float32\[4, 3\], value is float32\[2, 3\]"):
            tf1.assign(sess, {"a": np.zeros(2, np.float32), "dyn": np.zeros((2, 3), np.float32)})
        np.testing.assert_array_equal(tf1.export(sess)["dyn"], np.full((4, 3), 5))
        np.testing.assert_array_equal(tf1.export(sess)["a"], [3, 3])
        assert tuple(tf1.export_pieces(sess)["dyn"][0].shape) == (4, 3)
        assert tf1.assign(sess, {"a": np.ones(2, np.float32)}, exclude="dyn").assigned == ["a"]


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_a_variable_of_no_static_shape_that_holds_no_value_takes_the_shape_of_its_value(tmp_path, resource):
    """As ``Saver.restore`` does: its first value may have any shape (under a scope too), and
    from then on it is a variable of that shape."""
    with graph_session() as (graph, sess):
        fed = v1.placeholder(tf.float32, [None, 3])
        dyn = v1.Variable(fed, validate_shape=False, name="member/dyn", use_resource=resource)
        ws.save(tmp_path / "m.npz", {"dyn": np.arange(15, dtype=np.float32).reshape(5, 3)})
        assert tf1.assign(sess, tmp_path / "m.npz", scope="member").assigned == ["member/dyn"]
        np.testing.assert_array_equal(sess.run(dyn), np.arange(15).reshape(5, 3))
        with pytest.raises(AssignmentError, match=r"dyn: variable is float32\[5, 3\], value is float32\[2, 3\]"):
            tf1.assign(sess, {"member/dyn": np.zeros((2, 3), np.float32)})
        np.testing.assert_array_equal(sess.run(dyn), np.arange(15).reshape(5, 3))


def test_a_variable_of_partly_known_shape_that_holds_no_value_takes_only_a_value_that_fits_it():
    with graph_session() as (graph, sess):
        fed = v1.placeholder(tf.float32, [None, 3])
        dyn = v1.Variable(fed, validate_shape=False, shape=[None, 3], name="dyn", use_resource=True)
        with pytest.raises(AssignmentError, match=r"dyn: variable is float32\[5, 3\], value is float32\[5, 4\]"):
            tf1.assign(sess, {"dyn": np.ones((5, 4), np.float32)})
        with pytest.raises(AssignmentError, match=r"cannot assign 'dyn' of shape \[5, 3, 1\] to variable 'dyn', "
                                                  r"declared of shape \(None, 3\) \(it holds no value yet\)"):
            tf1.assign(sess, {"dyn": np.ones((5, 3, 1), np.float32)})
        assert tf1.assign(sess, {"dyn": np.ones((5, 3), np.float32)}).assigned == ["dyn"]
        assert sess.run(dyn).shape == (5, 3)


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_a_graph_with_a_saver_is_written_through_its_restore_ops_and_the_saver_still_restores(tmp_path, resource):
    """The variables are fed through the Saver's own restore ops (they compile faster than the
    initializers): every value lands, partitioned ones too, nothing is added to the graph, and
    the Saver, run unfed, still restores its checkpoint."""
    values_in = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "p": np.arange(8, dtype=np.float32).reshape(4, 2),
                 "b": np.array([3, 4], np.int64)}
    ws.save(tmp_path / "w.npz", values_in)
    with graph_session() as (graph, sess):
        made = [v1.get_variable("a", [2, 3], initializer=v1.random_normal_initializer(), use_resource=resource),
                *v1.get_variable("p", [4, 2], partitioner=v1.fixed_size_partitioner(2), use_resource=resource),
                v1.get_variable("b", [2], tf.int64, v1.zeros_initializer(), use_resource=resource)]
        saver = v1.train.Saver()
        v1.train.Saver(reshape=True)  # a second Saver whose restore ops reshape: not a writer
        sess.run(v1.global_variables_initializer())
        prefix = saver.save(sess, str(tmp_path / "ckpt" / "model"))
        saved = values(sess, made)
        graph.finalize()
        writers = {v.op.name: tf1._writer(graph, v)[0] for v in made}
        assert all(op.name.startswith("save/") for op in writers.values())
        # fed at the restore op itself, not at a resource variable's Identity of it
        assert {tf1._writer(graph, v)[1].op.type for v in made} == {"RestoreV2"}
        tf1.assign(sess, tmp_path / "w.npz")
        exported = tf1.export(sess)
        for key, value in values_in.items():
            np.testing.assert_array_equal(exported[key], value)
        saver.restore(sess, prefix)
        for got, want in zip(values(sess, made), saved, strict=True):
            np.testing.assert_array_equal(got, want)


def test_finalized_graph_and_monitored_training_session(tmp_path):
    ws.save(tmp_path / "w.npz", {"w": np.full(3, 7, np.float32), "global_step": np.int64(40)})
    with tf.Graph().as_default() as graph:
        v1.train.create_global_step()
        v1.get_variable("w", [3])
        train = v1.assign_add(v1.train.get_global_step(), 1)
        with v1.train.MonitoredTrainingSession() as sess:
            assert graph.finalized
            assert tf1.assign(sess, tmp_path / "w.npz").left_out == ["global_step"]  # training state: only if asked
            report = tf1.assign(sess, tmp_path / "w.npz", optimizer=True)
            assert sorted(report.assigned) == ["global_step", "w"]
            sess.run(train)
            exported = tf1.export(sess)
            assert exported["global_step"] == 41
            np.testing.assert_array_equal(exported["w"], [7, 7, 7])


def test_a_monitored_session_with_hooks_exports_and_assigns_without_running_them(tmp_path):
    """A hook's fetches run on each ``MonitoredSession.run``: a ``NanTensorHook`` on a loss fed by
    a placeholder would need the training step's feeds, and a counting hook would count reads."""
    with tf.Graph().as_default():
        v1.train.create_global_step()
        x = v1.placeholder(tf.float32, [None, 3])
        w = v1.get_variable("w", [3, 1])
        loss = tf.reduce_mean(tf.matmul(x, w) ** 2)
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=v1.train.get_global_step())
        hooks = [v1.train.NanTensorHook(loss)]
        with v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            sess.run(train, {x: np.ones((2, 3), np.float32)})
            exported = tf1.export(sess)
            assert exported["global_step"] == 1 and exported["w"].shape == (3, 1)
            ws.save(tmp_path / "w.npz", {"w": np.full((3, 1), 3, np.float32)})
            assert tf1.assign(sess, tmp_path / "w.npz").assigned == ["w"]
            assert tf1.assign(sess, ws.publish(tmp_path / "run", {"w": np.full((3, 1), 2, np.float32)}, step=1)
                              ).assigned == ["w"]
            assert tf1.assign(sess, ws.latest(tmp_path / "run")).skipped == ["w"]  # remembered across calls
            tf1.forget(sess)
            assert tf1.assign(sess, ws.latest(tmp_path / "run")).assigned == ["w"]
            np.testing.assert_array_equal(tf1.export(sess)["w"], np.full((3, 1), 2))
        with pytest.raises(ValueError, match="the session is closed"):
            tf1.export(sess)


def test_trainable_only():
    with graph_session() as (_, sess):
        w = v1.get_variable("layer/w", [2], initializer=v1.zeros_initializer())
        mean = v1.get_variable("layer/moving_mean", [2], initializer=v1.zeros_initializer(), trainable=False)
        sess.run(v1.global_variables_initializer())
        assert list(tf1.export(sess, trainable_only=True)) == ["layer/w"]
        report = tf1.assign(sess, {"layer/w": np.ones(2, np.float32)}, trainable_only=True)
        assert report.ok and report.assigned == ["layer/w"]
        np.testing.assert_array_equal(values(sess, [w, mean]), [[1, 1], [0, 0]])
        with pytest.raises(SelectionError, match="trainable_only"):
            tf1.export(sess, include="layer/moving_mean", trainable_only=True)


def test_also_adds_chosen_non_trainable_variables_to_trainable_only():
    with graph_session() as (_, sess):
        w = v1.get_variable("net/bn/gamma", [2], initializer=v1.zeros_initializer())
        mean = v1.get_variable("net/bn/moving_mean", [2], initializer=v1.zeros_initializer(), trainable=False)
        v1.get_variable("net/step", [], initializer=v1.zeros_initializer(), trainable=False)
        sess.run(v1.global_variables_initializer())
        exported = tf1.export(sess, scope="net", trainable_only=True, also="*/moving_*")
        assert list(exported) == ["bn/gamma", "bn/moving_mean"]  # also= is relative to the scope, like include
        report = tf1.assign(sess, {"bn/gamma": np.ones(2, np.float32), "bn/moving_mean": np.ones(2, np.float32)},
                            scope="net", trainable_only=True, also="bn/moving_mean")
        assert report.ok and report.assigned == ["net/bn/gamma", "net/bn/moving_mean"]
        np.testing.assert_array_equal(values(sess, [w, mean]), [[1, 1], [1, 1]])
        with pytest.raises(SelectionError, match=r"keeps nothing of the graph: every selected variable is non-trainable$"):
            tf1.export(sess, include="net/step", trainable_only=True)
        with pytest.raises(SelectionError) as caught:  # a word that matches nothing is a typo, never ignored
            tf1.export(sess, trainable_only=True, also="*/bn/moving_variance")
        assert str(caught.value) == ("also '*/bn/moving_variance' matches no key in the graph; "
                                     "did you mean 'net/bn/moving_mean'?")
        for call in (lambda: tf1.export(sess, also="*/moving_*"),  # trainable_only forgotten: not silently all
                     lambda: tf1.assign(sess, {"net/bn/gamma": np.zeros(2, np.float32)}, also="*/moving_*")):
            with pytest.raises(SelectionError, match=r"also= adds .* to what trainable_only=True keeps; pass"):
                call()
        np.testing.assert_array_equal(values(sess, [w, mean]), [[1, 1], [1, 1]])


def test_optimizer_slots_under_their_variable_round_trip(tmp_path):
    """``w`` is a key and also the scope of ``w/Adagrad``: HDF5 must hold both."""

    def build():
        w = v1.get_variable("w", [3], initializer=v1.constant_initializer(1.0))
        train = v1.train.AdagradOptimizer(0.5).minimize(tf.reduce_sum(w * w))
        return w, train

    with graph_session() as (_, sess):
        _, train = build()
        sess.run(v1.global_variables_initializer())
        for _ in range(3):
            sess.run(train)
        trained = tf1.export(sess)
    assert sorted(trained) == ["w", "w/Adagrad"]
    for suffix in ("npz", "h5"):
        ws.save(tmp_path / f"t.{suffix}", trained)
        with graph_session() as (_, sess):
            build()
            assert tf1.assign(sess, tmp_path / f"t.{suffix}", optimizer=True).ok
            got = tf1.export(sess)
            for key in trained:
                np.testing.assert_array_equal(got[key], trained[key])
            assert list(tf1.export(sess, scope="w")) == ["Adagrad"]


def test_repeated_assigns_keep_graph_and_memory_flat(tmp_path):
    rng = np.random.default_rng(0)
    weights = {f"layer_{i}/w": rng.standard_normal((256, 256)).astype(np.float32) for i in range(4)}
    weights["layer_0/b"] = np.zeros(256, np.float32)
    ws.save(tmp_path / "w.npz", weights)
    with graph_session() as (graph, sess):
        for key, value in weights.items():
            v1.get_variable(key, value.shape, use_resource=not key.startswith("layer_1"))
        graph.finalize()
        for _ in range(20):  # warm up allocator and caches before measuring
            tf1.assign(sess, tmp_path / "w.npz")
        ops, rss = len(graph.get_operations()), _rss()
        for i in range(1000):
            tf1.assign(sess, tmp_path / "w.npz" if i % 2 else weights)
        assert len(graph.get_operations()) == ops
        assert _rss() - rss < 50 << 20
        np.testing.assert_array_equal(tf1.export(sess)["layer_2/w"], weights["layer_2/w"])


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_shared_initial_value_gets_its_own_assign_op():
    """``tf.Variable(t)`` twice shares ``t``: feeding it would write one value into both."""
    with graph_session() as (graph, sess):
        init = tf.zeros([3])
        a = v1.Variable(init, name="a")
        b = v1.Variable(init, name="b", use_resource=False)
        tf1.assign(sess, {"a": np.ones(3, np.float32), "b": np.full(3, 2, np.float32)})
        np.testing.assert_array_equal(values(sess, [a, b]), [[1, 1, 1], [2, 2, 2]])
        ops = len(graph.get_operations())
        graph.finalize()
        tf1.assign(sess, {"a": np.full(3, 5, np.float32), "b": np.full(3, 6, np.float32)})
        assert len(graph.get_operations()) == ops
        np.testing.assert_array_equal(values(sess, [a, b]), [[5, 5, 5], [6, 6, 6]])
    with graph_session() as (graph, sess):
        init = tf.zeros([3])
        v1.Variable(init, name="a"), v1.Variable(init, name="b")
        graph.finalize()
        with pytest.raises(AssignmentError, match="finalized"):
            tf1.assign(sess, {"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)})


def test_a_variable_sharing_an_initial_value_added_between_assigns_gets_its_own_value():
    """Writers are remembered between assigns only while the graph gains no op."""
    with graph_session() as (graph, sess):
        init = tf.zeros([3])
        a = v1.Variable(init, name="a")
        tf1.assign(sess, {"a": np.ones(3, np.float32)})
        b = v1.Variable(init, name="b")  # now feeding init would write into a and b alike
        for step in range(2):
            tf1.assign(sess, {"a": np.full(3, 5 + step, np.float32), "b": np.full(3, 7 + step, np.float32)})
            np.testing.assert_array_equal(values(sess, [a, b]), [[5 + step] * 3, [7 + step] * 3])
            graph.finalize()


def test_a_partitioned_variable_missing_parts_is_a_weightstore_error():
    with graph_session() as (graph, sess):
        v1.get_variable("p", [4, 2], partitioner=v1.fixed_size_partitioner(2))
        sess.run(v1.global_variables_initializer())
        last = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)[-1]
        for collection in graph.get_all_collection_keys():  # one part of "p" no longer in any collection
            members = graph.get_collection_ref(collection)
            if last in members:
                members.remove(last)
        with pytest.raises(FormatError, match="'p': its parts in the graph's collections cover 4 of 8"):
            tf1.export(sess)


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_variables_never_share_memory_with_the_values(tmp_path, resource):
    """TF adopts aligned fed memory; the caller's array and the file's map must stay apart."""
    raw = np.empty(4096 * 4 + 64, np.uint8)
    value = raw[-raw.ctypes.data % 64:][:4096 * 4].view(np.float32)  # aligned: TF would adopt it
    value[:] = 1
    ws.save(tmp_path / "w.npz", {"w": value})
    with graph_session() as (_, sess):
        w = v1.get_variable("w", [4096], use_resource=resource)
        step = v1.assign_add(w, tf.ones([4096]))
        tf1.assign(sess, {"w": value})
        value[:] = 9
        assert sess.run(w)[0] == 1
        with ws.open(tmp_path / "w.npz") as store:
            tf1.assign(sess, store)
            sess.run(step)  # a write into a read-only map would crash here
            assert store["w"][0] == 1
        assert sess.run(w)[0] == 2
        exported = tf1.export(sess)["w"]
        sess.run(step)
        assert exported[0] == 2 and exported.flags.writeable


def test_assign_reads_only_what_it_assigns(tmp_path):
    """A corrupt tensor outside the selection is never read, so its checksum never fails."""
    path = tmp_path / "w.npz"
    marker = np.full(64, 0x5A5A5A5A, np.uint32)
    ws.save(path, {"keep/w": np.ones(2, np.float32), "other/w": marker})
    data = bytearray(path.read_bytes())
    at = data.find(marker.tobytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with graph_session() as (_, sess):
        w = v1.get_variable("keep/w", [2])
        assert tf1.assign(sess, path, include="keep").assigned == ["keep/w"]
        np.testing.assert_array_equal(sess.run(w), [1, 1])
        v1.get_variable("other/w", [64], dtype=tf.uint32, initializer=v1.zeros_initializer())
        with pytest.raises(ChecksumError):
            tf1.assign(sess, path)


def test_skip_unchanged(tmp_path):
    first = {"a": np.ones(3, np.float32), "p": np.arange(8, dtype=np.float32).reshape(4, 2)}
    second = {"a": first["a"], "p": first["p"] + 1}
    ws.save(tmp_path / "1.npz", first, digests=True)  # what versions record, and skipping compares
    ws.save(tmp_path / "2.npz", second, digests=True)
    with graph_session() as (_, sess):
        a = v1.get_variable("a", [3])
        part = v1.get_variable("p", [4, 2], partitioner=v1.fixed_size_partitioner(2))
        poke = v1.assign_add(a, tf.ones([3]))
        version = Version(step=1, path=str(tmp_path / "1.npz"), created="")
        assert tf1.assign(sess, version).assigned == ["a", "p"]
        assert tf1.assign(sess, version).skipped == ["a", "p"]
        sess.run(poke)  # only a version's own bytes are remembered: a is now 2 in the graph
        report = tf1.assign(sess, Version(step=2, path=str(tmp_path / "2.npz"), created=""))
        assert report.skipped == ["a"] and report.assigned == ["p"]
        np.testing.assert_array_equal(sess.run(a), [2, 2, 2])
        np.testing.assert_array_equal(np.concatenate(values(sess, list(part))), second["p"])
        # a plain path is always written (re-assigning undoes training) unless asked otherwise
        assert tf1.assign(sess, tmp_path / "2.npz").assigned == ["a", "p"]
        np.testing.assert_array_equal(sess.run(a), [1, 1, 1])
        assert tf1.assign(sess, tmp_path / "2.npz", skip_unchanged=True).skipped == ["a", "p"]
        # a dict has no checksums: written, and forgotten so the next version is written too
        tf1.assign(sess, second)
        assert tf1.assign(sess, tmp_path / "2.npz", skip_unchanged=True).assigned == ["a", "p"]


def test_assigning_does_not_keep_the_graph_alive(tmp_path):
    import gc
    import weakref

    with tf.Graph().as_default() as graph, tf.compat.v1.Session() as sess:
        tf.compat.v1.get_variable("w", [1000, 100])
        sess.run(tf.compat.v1.global_variables_initializer())
        tf1.assign(sess, tf1.export(sess))
    alive = weakref.ref(graph)
    del graph, sess
    gc.collect()
    assert alive() is None


def test_a_variable_frozen_by_editing_the_collection_is_seen(tmp_path):
    with tf.Graph().as_default() as graph, tf.compat.v1.Session() as sess:
        tf.compat.v1.get_variable("a", [2], trainable=True)
        b = tf.compat.v1.get_variable("b", [2], trainable=False)
        sess.run(tf.compat.v1.global_variables_initializer())
        assert list(tf1.export(sess, trainable_only=True)) == ["a"]
        graph.get_collection_ref(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)[0] = b  # same length, no new op
        assert list(tf1.export(sess, trainable_only=True)) == ["b"]


# -- bounded batches: one session.run per batch, everything verified before the first ---------
FLOATS = 32768  # 128 KiB a tensor: over HDF5's 64 KiB sieve buffer, so a tensor read again comes from the file


class CountingSession(v1.Session):
    """A real session that counts an assign's batches run in it, and can act after one (``after_feed``);
    counted by the ``batches_counted`` fixture."""

    def __init__(self, *args, after_feed=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.feeding_runs = 0
        self.after_feed = after_feed


@pytest.fixture
def batches_counted(monkeypatch):
    """Every batch a TF1 assign runs (as a callable or through ``session.run``) counted on its CountingSession."""
    run = _tf1_callables.run

    def counted(sess, writers, feeds):
        run(sess, writers, feeds)
        if isinstance(sess, CountingSession):
            sess.feeding_runs += 1
            if sess.after_feed:
                sess.after_feed(sess.feeding_runs)

    monkeypatch.setattr(_tf1_callables, "run", counted)


@pytest.fixture
def two_per_batch(monkeypatch):
    """A budget of two of the tensors below, so six of them take three runs."""
    monkeypatch.setattr(skeleton, "BATCH_MIN_BYTES", 2 * FLOATS * 4)


def six_values() -> dict[str, np.ndarray]:
    return {f"layer_{i}/w": np.full(FLOATS, i + 1, np.float32) for i in range(6)}


def six_variables():
    return [v1.get_variable(f"layer_{i}/w", [FLOATS], initializer=v1.zeros_initializer(),
                            use_resource=i % 2 == 0) for i in range(6)]


@contextlib.contextmanager
def six_variables_session():
    """A graph of :func:`six_variables`, initialised in a session of its own: (graph, session, variables)."""
    graph = tf.Graph()
    with graph.as_default():
        variables = six_variables()
        init = v1.global_variables_initializer()
    with v1.Session(graph=graph) as sess:
        sess.run(init)
        yield graph, sess, variables


@pytest.mark.parametrize("route", ["dict", "npz", "h5"])
def test_batched_assign_equals_one_shot_and_runs_once_per_batch(tmp_path, monkeypatch, batches_counted, route):
    weights = six_values()
    source = weights if route == "dict" else tmp_path / f"w.{route}"
    if route != "dict":
        ws.save(source, weights)
    with tf.Graph().as_default() as graph, CountingSession(graph=graph) as sess:
        variables = six_variables()
        sess.run(v1.global_variables_initializer())
        assert tf1.assign(sess, source).assigned == list(weights)
        assert sess.feeding_runs == 1  # 768 KiB: one batch of the 32 MB minimum
        one_shot = values(sess, variables)
        sess.run(v1.global_variables_initializer())
        monkeypatch.setattr(skeleton, "BATCH_MIN_BYTES", 2 * FLOATS * 4)
        assert tf1.assign(sess, source).assigned == list(weights)
        # a batch holds two values that cost new memory: a ref variable copies a value the verify
        # pass kept (a view of the mapped npz, an HDF5 read) in place, at no cost, so six fit in
        # two batches; a value that pass did not keep (a dict's, beyond its budget) counts whole
        assert sess.feeding_runs == 1 + (3 if route == "dict" else 2)
        batched = values(sess, variables)
    for got_once, got_batched, expected in zip(one_shot, batched, weights.values(), strict=True):
        np.testing.assert_array_equal(got_once, expected)
        np.testing.assert_array_equal(got_batched, expected)


def test_a_session_keeps_its_latest_batches_compiled_and_is_freed_when_dropped(two_per_batch, monkeypatch):
    """Each batch runs as a callable the session compiled once; assigns of one subset after another
    (hot reloads) leave the latest KEPT of them, values right throughout, and nothing weightstore
    holds keeps a dropped session (and its variables) alive until a garbage collection."""
    monkeypatch.setattr(_tf1_callables, "KEPT", 2)
    weights = six_values()
    graph = tf.Graph()
    with graph.as_default():
        variables = six_variables()
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph)
    sess.run(init)
    for _ in range(2):  # three batches of two: the third forgets the first's callable
        tf1.assign(sess, weights)
    tenfold = {key: value * 10 for key, value in weights.items()}
    for i in range(6):
        assert tf1.assign(sess, tenfold, include=f"layer_{i}/w").assigned == [f"layer_{i}/w"]
    assert len(sess._weightstore_callables._entries) == 2
    for i, got in enumerate(values(sess, variables)):
        np.testing.assert_array_equal(got, weights[f"layer_{i}/w"] * 10)
    dropped = weakref.ref(sess)
    with paused_gc():
        del sess
        assert dropped() is None


def test_the_first_assign_compiles_its_batch_once_started_before_the_file_is_opened(tmp_path, monkeypatch):
    """The first assign into a session hands the helper, before opening the file, the finding and
    compiling of the batch it will run (here run at once, as a helper that starts at once would),
    and the staging session's warm-up for that batch's resource variables; the assign runs that
    very callable though the file lists the keys in another order; an assign of a subset then
    compiles its own, with no guess (the session compiled before)."""
    weights = six_values()
    path = tmp_path / "w.npz"
    ws.save(path, dict(reversed(weights.items())))
    compiled: list[tuple[str, ...]] = []
    compile_ = _tf1_callables._compile
    monkeypatch.setattr(_tf1_callables, "_compile",
                        lambda sess, signature: compiled.append(signature[0]) or compile_(sess, signature))
    warmed: list[list[tuple[tuple[int, ...], np.dtype]]] = []
    monkeypatch.setattr(tf1, "warm", warmed.append)
    beside_ = _tf1_callables.beside
    monkeypatch.setattr(_tf1_callables, "beside", lambda job: (job(), beside_(lambda: None))[1])  # run at once, in full
    seen_at_open: list[tuple[int, int]] = []
    open_values = skeleton.open_values

    def opened(weights):
        seen_at_open.append((len(compiled), len(warmed)))
        return open_values(weights)

    monkeypatch.setattr(skeleton, "open_values", opened)
    with six_variables_session() as (graph, sess, variables):
        assert tf1.assign(sess, path).assigned == list(reversed(weights))
        assert seen_at_open == [(1, 1)]
        assert len(compiled) == 1 and len(compiled[0]) == 6
        assert warmed == [[((FLOATS,), np.dtype(np.float32))] * 3]  # the resource variables: layers 0, 2, 4
        for got, expected in zip(values(sess, variables), weights.values(), strict=True):
            np.testing.assert_array_equal(got, expected)
        tf1.assign(sess, path, include="layer_1/w")
        assert [len(signature) for signature in compiled] == [6, 1]
        assert len(warmed) == 1


def test_the_guess_on_the_helper_ends_before_the_assign_returns(tmp_path, monkeypatch):
    """However late the helper runs the first assign's guess, the assign waits for it (or runs it
    itself): nothing of it runs after the assign returns, so it adds no op to the graph the user
    goes on building, even one whose new ops share the variables' initial values."""
    weights = six_values()
    path = tmp_path / "w.npz"
    ws.save(path, weights)
    handed: list[object] = []
    beside_ = _tf1_callables.beside

    def late(job):
        def delayed():
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.3)  # a helper busy elsewhere, or without a core
            return job()
        handed.append(beside_(delayed))
        return handed[-1]

    monkeypatch.setattr(_tf1_callables, "beside", late)
    with six_variables_session() as (graph, sess, variables):
        assert tf1.assign(sess, path).assigned == list(weights)
        assert handed and all(job._future is None or job._future.done() for job in handed)
        before = {op.name for op in graph.get_operations()}
        with graph.as_default():
            for variable in variables:
                variable.assign(variable.initial_value)  # the user's own graph building goes on
        time.sleep(0.5)
        ours = [op.name for op in graph.get_operations() if op.name not in before and "weightstore" in op.name]
        assert ours == []
        for got, expected in zip(values(sess, variables), weights.values(), strict=True):
            np.testing.assert_array_equal(got, expected)


def test_the_first_assign_verifies_its_file_while_the_helper_compiles_its_batch(tmp_path, monkeypatch):
    """The guess's compile runs beside the verify pass, not before it: the assign waits for the
    helper only while it looks the writers up, then reads and checks the file while the batch
    compiles (a cold file's read and the compile took turns, and the first call's wall was their
    sum). Here the compile goes on only once the file is being read, which it never would if the
    assign waited for it first; the batch then runs that very callable."""
    weights = six_values()
    path = tmp_path / "w.npz"
    ws.save(path, weights)
    compiling, reading = threading.Event(), threading.Event()
    compiled: list[tuple[bool, bool]] = []  # (on the helper, the file read meanwhile)
    compile_ = _tf1_callables._compile

    def compile_once_reading(sess, signature):
        compiling.set()
        compiled.append((threading.current_thread() is not threading.main_thread(), reading.wait(timeout=5)))
        return compile_(sess, signature)

    monkeypatch.setattr(_tf1_callables, "_compile", compile_once_reading)
    open_values, prefetch = skeleton.open_values, Values.prefetch

    def opened(weights):
        assert compiling.wait(timeout=10)  # the helper has begun the guess and found its writers
        return open_values(weights)

    def read(self, keys):
        reading.set()
        return prefetch(self, keys)

    monkeypatch.setattr(skeleton, "open_values", opened)
    monkeypatch.setattr(Values, "prefetch", read)
    with six_variables_session() as (graph, sess, variables):
        assert tf1.assign(sess, path).assigned == list(weights)
        assert compiled == [(True, True)]
        for got, expected in zip(values(sess, variables), weights.values(), strict=True):
            np.testing.assert_array_equal(got, expected)


def test_a_guess_that_fails_on_the_helper_costs_the_assign_nothing(tmp_path, monkeypatch):
    """The guess only gets ahead of work the assign does anyway: its failure (here the staging
    warm-up's) is not the assign's, which compiles and stages for itself."""
    weights = six_values()
    path = tmp_path / "w.npz"
    ws.save(path, weights)

    def warm_fails(shapes):
        raise RuntimeError("the staging warm-up failed")

    monkeypatch.setattr(tf1, "warm", warm_fails)
    with six_variables_session() as (graph, sess, variables):
        assert tf1.assign(sess, path).assigned == list(weights)
        for got, expected in zip(values(sess, variables), weights.values(), strict=True):
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("fmt", ["npz", "h5"])
def test_a_bad_value_in_a_later_batch_changes_nothing(tmp_path, two_per_batch, batches_counted, fmt):
    weights = six_values()
    path = tmp_path / f"w.{fmt}"
    ws.save(path, weights)
    data = bytearray(path.read_bytes())
    data[data.find(weights["layer_5/w"].tobytes()) + 100] ^= 0xFF  # the last batch's last value
    path.write_bytes(bytes(data))
    with tf.Graph().as_default() as graph, CountingSession(graph=graph) as sess:
        variables = six_variables()
        sess.run(v1.global_variables_initializer())
        with pytest.raises(ChecksumError, match="layer_5/w"):
            tf1.assign(sess, path)
        assert sess.feeding_runs == 0
        assert not any(got.any() for got in values(sess, variables))


def test_a_file_cut_in_place_during_the_verify_pass_changes_nothing(tmp_path, monkeypatch, two_per_batch,
                                                                    batches_counted):
    """A file cut short while the verify pass reads it, its pages faulted into the map ahead of
    the reads, fails the pass before any batch runs: no variable changes. (The size guard
    refuses it here; a populate past the new end is tests/test_io_ahead.py's.)"""
    weights = six_values()
    path = tmp_path / "w.npz"
    ws.save(path, weights)
    prefetch = Values.prefetch
    chunks: list[list[str]] = []

    def cut_at_the_second_chunk(self, keys):
        chunks.append(keys)
        if len(chunks) == 2:
            os.truncate(path, path.stat().st_size // 2)  # in place, as no weightstore writer ever does
        return prefetch(self, keys)

    monkeypatch.setattr(_local, "_advice_piece", lambda device: None)  # faulted in, whatever the device
    monkeypatch.setattr(Values, "prefetch", cut_at_the_second_chunk)
    with tf.Graph().as_default() as graph, CountingSession(graph=graph) as sess:
        variables = six_variables()
        sess.run(v1.global_variables_initializer())
        with pytest.raises(FormatError, match="changed size"):
            tf1.assign(sess, path)
        assert len(chunks) == 2 and sess.feeding_runs == 0
        assert not any(got.any() for got in values(sess, variables))


def test_a_file_rewritten_in_place_between_batches_says_what_was_written(tmp_path, two_per_batch, batches_counted):
    """What the verify pass cannot see: a value read again (owned reads, ``mmap=False``: one
    not kept from the verify pass) after the file changed under it."""
    weights = six_values()
    path = tmp_path / "w.h5"
    ws.save(path, weights, digests=True)  # the skip below compares digests
    good = path.read_bytes()
    at = good.find(weights["layer_5/w"].tobytes())

    def rewrite_after_first_batch(runs: int) -> None:
        if runs == 1:
            with open(path, "r+b") as handle:  # in place, as no weightstore writer ever does
                handle.seek(at)
                handle.write(b"\xff" * 8)

    with tf.Graph().as_default() as graph, CountingSession(graph=graph, after_feed=rewrite_after_first_batch) as sess:
        variables = six_variables()
        sess.run(v1.global_variables_initializer())
        with pytest.raises(AssignmentError, match=r"w\.h5: cannot assign: failed after 4 of 6 variables were written"
                           ) as caught, ws.open(path, mmap=False) as store:
            tf1.assign(sess, store)
        assert isinstance(caught.value.__cause__, ChecksumError) and caught.value.path == str(path)
        got = values(sess, variables)
        for i in range(6):
            np.testing.assert_array_equal(got[i], np.full(FLOATS, i + 1 if i < 4 else 0, np.float32))
        sess.after_feed = None
        path.write_bytes(good)
        report = tf1.assign(sess, path, skip_unchanged=True)  # the failed batch was forgotten: written again
        assert report.skipped == [f"layer_{i}/w" for i in range(4)]
        assert report.assigned == ["layer_4/w", "layer_5/w"]
        np.testing.assert_array_equal(values(sess, variables)[5], weights["layer_5/w"])


def test_partitioned_variables_and_shared_initial_values_in_batches(tmp_path, two_per_batch, batches_counted):
    """A key's parts travel in one batch; writers that cannot exist fail before the first batch."""
    weights = {"p": np.arange(4 * FLOATS, dtype=np.float32).reshape(4, FLOATS), **six_values()}
    with tf.Graph().as_default() as graph, CountingSession(graph=graph) as sess:
        v1.get_variable("p", [4, FLOATS], partitioner=v1.fixed_size_partitioner(2),
                        initializer=v1.zeros_initializer())
        variables = six_variables()
        sess.run(v1.global_variables_initializer())
        tf1.assign(sess, weights)
        np.testing.assert_array_equal(tf1.export(sess)["p"], weights["p"])
        assert sess.feeding_runs == 1 + 3  # p (four tensors' bytes) alone, then two by two
        np.testing.assert_array_equal(values(sess, variables)[5], weights["layer_5/w"])
    with tf.Graph().as_default() as graph, CountingSession(graph=graph) as sess:
        variables = six_variables()
        init = tf.zeros([FLOATS])
        v1.Variable(init, name="shared_a"), v1.Variable(init, name="shared_b")
        sess.run(v1.global_variables_initializer())
        graph.finalize()
        with pytest.raises(AssignmentError, match="finalized"):
            tf1.assign(sess, {**six_values(), "shared_a": np.ones(FLOATS, np.float32),
                              "shared_b": np.ones(FLOATS, np.float32)})
        assert sess.feeding_runs == 0
        assert not any(got.any() for got in values(sess, variables))


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_export_of_a_variable_with_no_value_yet_names_it(use_resource):
    """TF's FailedPreconditionError leaked as it was."""
    with tf.Graph().as_default(), v1.Session() as sess:
        ready = v1.get_variable("ready", (2,), use_resource=use_resource, initializer=v1.zeros_initializer())
        v1.get_variable("never_run", (2,), use_resource=use_resource)
        sess.run(ready.initializer)
        with pytest.raises(SelectionError, match="variable 'never_run' of the graph holds no value yet; initialize"):
            tf1.export(sess)
        assert tf1.export(sess, include="ready")["ready"].tolist() == [0.0, 0.0]


def test_a_closed_session_or_no_session_is_refused_before_anything_is_planned(tmp_path):
    with graph_session() as (graph, sess):
        v1.get_variable("w", [2], initializer=v1.zeros_initializer())
        sess.run(v1.global_variables_initializer())
        ws.save(tmp_path / "w.npz", tf1.export(sess))
    for call in (lambda: tf1.export(sess), lambda: tf1.assign(sess, tmp_path / "w.npz")):  # closed by now
        with pytest.raises(ValueError, match="the session is closed"):
            call()
    for wrong in (None, tf.keras.Sequential()):
        with pytest.raises(TypeError, match="expected a tf.compat.v1.Session"):
            tf1.assign(wrong, tmp_path / "w.npz")


def test_a_failed_first_assign_adds_no_op_to_a_graph_whose_variables_share_an_initial_value(tmp_path):
    """Variables made from one tensor need an assign op each, made by the assign that writes
    them; the first assign's guess at its batch never makes them, so a file that is not there
    leaves the graph as it was."""
    graph = tf.Graph()
    with graph.as_default():
        shared = tf.constant([1.0, 2.0])
        a, b = v1.Variable(shared, name="a"), v1.Variable(shared, name="b")
        init = v1.global_variables_initializer()
    with v1.Session(graph=graph) as sess:
        sess.run(init)
        ops = len(graph.get_operations())
        with pytest.raises(ws.StoreNotFoundError, match="missing.npz"):
            tf1.assign(sess, tmp_path / "missing.npz")
        assert len(graph.get_operations()) == ops
        ws.save(tmp_path / "w.npz", {"a": np.float32([3, 4]), "b": np.float32([5, 6])})
        tf1.assign(sess, tmp_path / "w.npz")
        np.testing.assert_array_equal(sess.run(a), [3, 4])
        np.testing.assert_array_equal(sess.run(b), [5, 6])
