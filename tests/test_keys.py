"""Keys, scopes, globs and mappings: the pure functions, and the same words through real files."""

from __future__ import annotations

import os

import numpy as np
import pytest

import weightstore as ws
from weightstore.core import keys as K

# -- key rules ------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", [
    "w", "model_001/conv_1/bn/beta", "a.b/c-d/e_f", "ünï/kérnel", "x/y:z", "w/Adagrad", "...x", "a/.hidden",
    "with space/x", "0/1/2",
])
def test_valid_keys(key):
    assert K.validate_key(key) == key


@pytest.mark.parametrize("key", [
    "", "/w", "w/", "a//b", "a/./b", "a/../b", "..", ".", "a\\b", "a\nb", "a\x00b", "tab\there", "a\x7fb",
    "dense/kernel:0", "w:12", "__weightstore__", "a/__weightstore_value__",
])
def test_invalid_keys_are_refused_naming_the_key(key):
    with pytest.raises(ws.InvalidKeyError) as info:
        K.validate_key(key)
    assert repr(key) in str(info.value)
    assert isinstance(info.value, ValueError)


INVALID_KEYS = [
    "", "/w", "w/", "a//b", "a/./b", "a/../b", "..", ".", "a\\b", "a\nb", "a\x00b", "tab\there", "a\x7fb",
    "dense/kernel:0", "w:12", "__weightstore__", "a/__weightstore_value__", "a/b\u202e", "e\u0301", "x" * 70_000,
]


@pytest.mark.parametrize("bad", INVALID_KEYS + [None, 3, b"w"])
@pytest.mark.parametrize("place", [0, 1, 2])
def test_many_keys_at_once_refuse_the_same_keys_as_one_at_a_time(bad, place):
    """The bulk check scans joined text: a bad key first, among others or last is found, named."""
    keys = ["a/w", "b/..x", "c/w:x"]
    keys.insert(place, bad)
    with pytest.raises(ws.InvalidKeyError) as info:
        K.validate_keys(keys)
    assert repr(bad)[:40] in str(info.value)


@pytest.mark.parametrize("keys", [[], ["w"], ["a/b", "a/b/c", "ünï/kérnel", "x:y/0", "...x", "a/.hidden"]])
def test_many_valid_keys_pass(keys):
    assert K.validate_keys(iter(keys)) == keys


@pytest.mark.parametrize("key", [None, 3, b"w", ("a",)])
def test_non_string_keys_are_refused(key):
    with pytest.raises(ws.InvalidKeyError) as info:
        K.validate_key(key)
    assert repr(key) in str(info.value)


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
@pytest.mark.parametrize("bad", ["a//b", "w:0", "../escape", "/abs", "a\\b", "", "x/./y", "__weightstore__", 7])
def test_invalid_key_refused_on_save_and_nothing_written(tmp_path, suffix, bad):
    path = tmp_path / f"w{suffix}"
    ws.save(path, {"old": np.arange(3)})
    before = path.read_bytes()
    weights = {"good/a": np.zeros(4), "good/b": np.ones(2), bad: np.zeros(1), "after": np.zeros(1)}
    with pytest.raises(ws.InvalidKeyError) as info:
        ws.save(path, weights)
    assert repr(bad) in str(info.value) and str(path) in str(info.value)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name]


# -- scopes ---------------------------------------------------------------------------------------

def test_scopes_match_whole_segments():
    assert K.in_scope("model_1", "model_1")
    assert K.in_scope("model_1/w", "model_1")
    assert not K.in_scope("model_10/w", "model_1")
    assert not K.in_scope("model_1x", "model_1")
    assert K.in_scope("anything", "")
    assert K.matches("model_1/dense/w", "model_1/dense")
    assert not K.matches("model_1/dense_1/w", "model_1/dense")
    assert K.matches("model_1/w", "model_1/")  # a trailing '/' is how users often type a scope


def test_globs_cross_slashes_and_match_whole_keys():
    assert K.matches("model_1/dense/kernel", "model_*/kernel")  # '*' crosses '/'
    assert K.matches("model_1/dense/kernel", "*kernel")
    assert not K.matches("model_1/dense/kernel", "*dense")  # whole key, not a prefix
    assert K.matches("model_7/w", "model_?/w")
    assert not K.matches("model_10/w", "model_?/w")
    assert K.matches("model_3/w", "model_[0-4]/*")
    assert not K.matches("model_5/w", "model_[0-4]/*")
    assert not K.matches("Model_1/w", "model_*")  # case matters


def test_select_include_exclude():
    weights = {k: k for k in ["model_1/w", "model_1/b", "model_10/w", "model_2/w", "head/w"]}
    assert list(ws.select(weights, include="model_1")) == ["model_1/w", "model_1/b"]
    assert list(ws.select(weights, include=["model_1", "head"])) == ["model_1/w", "model_1/b", "head/w"]
    assert list(ws.select(weights, exclude="model_1")) == ["model_10/w", "model_2/w", "head/w"]
    assert list(ws.select(weights, include="model_*", exclude="*/b")) == ["model_1/w", "model_10/w", "model_2/w"]
    assert list(ws.select(weights, include="*/w", exclude=["model_10", "model_2"])) == ["model_1/w", "head/w"]
    assert ws.select(weights) == weights and ws.select(weights) is not weights


def test_select_that_keeps_nothing_is_an_error_with_a_suggestion():
    weights = {"model_001/w": 1, "model_002/w": 2}
    with pytest.raises(ws.SelectionError) as info:
        ws.select(weights, include="model_01")
    assert "model_01" in str(info.value) and "did you mean 'model_001'" in str(info.value)
    with pytest.raises(ValueError):
        ws.select(weights, exclude="*")


# -- mapping --------------------------------------------------------------------------------------

def test_mapping_rules():
    weights = {"model_001/w": 1, "model_0010/w": 2, "head/b": 3, "model_001": 4}
    assert ws.remap(weights, mapping=["model_001=student"]) == {
        "student/w": 1, "model_0010/w": 2, "head/b": 3, "student": 4}
    assert ws.remap(weights, mapping={"head": "new/head"})["new/head/b"] == 3
    assert list(ws.remap(weights, mapping=["=under"])) == ["under/model_001/w", "under/model_0010/w",
                                                          "under/head/b", "under/model_001"]
    assert ws.remap({"model_001/w": 1, "head/b": 3}, mapping=["model_001="]) == {"w": 1, "head/b": 3}


def test_first_matching_rule_wins():
    weights = {"a/b/c": 1, "a/x": 2}
    assert ws.remap(weights, mapping=["a/b=first", "a=second"]) == {"first/c": 1, "second/x": 2}
    with pytest.raises(ws.SelectionError, match="never applies"):  # a/b=first could rename nothing
        ws.remap(weights, mapping=["a=second", "a/b=first"])


def test_mapping_then_scope():
    weights = {"model_001/w": 1, "other": 2}
    assert ws.remap(weights, mapping="model_001=student", scope="ensemble") == {
        "ensemble/student/w": 1, "ensemble/other": 2}
    assert ws.remap(weights, scope="ensemble/") == {"ensemble/model_001/w": 1, "ensemble/other": 2}


def test_mapping_collisions_and_bad_rules():
    with pytest.raises(ws.InvalidKeyError) as info:
        ws.remap({"a/w": 1, "b/w": 2}, mapping=["a=c", "b=c"])
    assert "'a/w'" in str(info.value) and "'b/w'" in str(info.value) and "c/w" in str(info.value)
    assert info.value.key == "c/w"  # the key two keys would share
    with pytest.raises(ws.InvalidKeyError) as info:
        ws.remap({"w": 1}, mapping=["no-equals-sign"])
    assert "no-equals-sign" in str(info.value)
    with pytest.raises(ws.InvalidKeyError) as info:
        ws.remap({"w": 1}, mapping=["w="])  # would leave an empty key
    assert info.value.key == "w"
    with pytest.raises(ws.InvalidKeyError):
        ws.remap({"w": 1}, mapping=["w=../up"])
    with pytest.raises(ws.SelectionError, match="mapping a/b=q never applies: the earlier rule a=p renames"):
        ws.remap({"a/b/w": 1, "a/c": 2}, mapping=["a=p", "a/b=q"])  # a shadowed rule is a mistake, not ignored
    assert ws.remap({"a/b/w": 1, "a/c": 2}, mapping=["a/b=q", "a=p"]) == {"q/w": 1, "p/c": 2}


def test_a_mapping_that_breaks_a_files_keys_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "m.npz"
    ws.save(path, {"a/w": np.ones(1), "b/w": np.ones(1)})
    with pytest.raises(ws.InvalidKeyError, match="tensor 'c/w': keys 'a/w' and 'b/w' both become it") as info:
        ws.load(path, mapping=["a=c", "b=c"])
    assert (info.value.path, info.value.key) == (str(path), "c/w")
    with pytest.raises(ws.InvalidKeyError, match="tensor 'a/w': mapping a/w= turns it into an empty key") as info:
        ws.load(path, mapping=["a/w="])
    assert (info.value.path, info.value.key) == (str(path), "a/w")
    ws.save(path, {"net/a/w": np.ones(1), "net/b/w": np.ones(1)})
    with pytest.raises(ws.InvalidKeyError, match="tensor 'net/a/w': mapping a/w= turns it into an empty key") as info:
        ws.load(path, scope="net", mapping=["a/w="])  # the key as the file has it, not relative to the scope
    assert (info.value.path, info.value.key) == (str(path), "net/a/w")


def test_a_mapping_rule_that_matches_no_key_is_refused_naming_the_closest(tmp_path):
    """A typo in FROM would leave the keys it was written to rename as they were."""
    with pytest.raises(ws.SelectionError, match=r"mapping dnse=foo matches no key; did you mean 'dense'\?"):
        ws.remap({"dense/kernel": 1, "head/w": 2}, mapping=["dnse=foo"])
    ws.save(tmp_path / "m.npz", {"dense/kernel": np.ones(2), "head/w": np.ones(1)})
    with pytest.raises(ws.SelectionError, match=r"m\.npz: mapping dnse=foo matches no key; did you mean 'dense'\?"):
        ws.load(tmp_path / "m.npz", mapping="dnse=foo")
    assert ws.load(tmp_path / "m.npz", mapping=["dense=foo", "=all"]).keys() == {"foo/kernel", "all/head/w"}


def test_a_rule_between_the_ends_of_keys_renames_them_and_takes_the_place_of_the_raw_key(tmp_path):
    """``*/FROM=*/TO`` (or ``=*``) renames the last segments of every key ending in FROM: an EMA
    shadow ``w/ExponentialMovingAverage`` is read as ``w``, in place of the raw ``w``; a key without
    a shadow stays. In the API, the CLI, inward and outward alike; FROM and TO are whole segments."""
    weights = {"w": 1, "w/ExponentialMovingAverage": 2, "net/b": 3, "net/b/ExponentialMovingAverage": 4, "step": 5}
    assert ws.remap(weights, mapping={"*/ExponentialMovingAverage": "*"}) == {"w": 2, "net/b": 4, "step": 5}
    assert ws.remap(weights, mapping=["*/ExponentialMovingAverage=*/ema"], scope="m") == {
        "m/w": 1, "m/w/ema": 2, "m/net/b": 3, "m/net/b/ema": 4, "m/step": 5}
    ws.save(tmp_path / "m.npz", {key: np.full(2, value) for key, value in weights.items()})
    loaded = ws.load(tmp_path / "m.npz", scope="net", mapping="*/ExponentialMovingAverage=*")
    assert {key: int(value[0]) for key, value in loaded.items()} == {"b": 4}
    with pytest.raises(ws.SelectionError, match=r"mapping \*/MovingAverage=\* matches no key"):
        ws.remap(weights, mapping={"*/MovingAverage": "*"})  # whole segments: no key ends in that one
    with pytest.raises(ws.InvalidKeyError, match="both become it"):
        ws.remap({"a/x": 1, "a/y": 2}, mapping=["*/x=*", "*/y=*"])
    for rule in ("*/x=y", "x=*", "x=*/y", "*/x*=*", "*=*"):
        with pytest.raises(ws.InvalidKeyError, match=r"is neither FROM=TO between scopes nor \*/FROM=\*/TO"):
            ws.remap(weights, mapping=[rule])


def test_a_rule_between_the_ends_of_keys_replaces_a_real_key_only_when_it_removes_a_suffix():
    """Only ``*/FROM=*`` (the EMA shadow read as its variable) takes the place of a key of the
    name it gives; ``*/gamma=*/scale`` beside a real ``bn/scale`` would drop one silently."""
    with pytest.raises(ws.InvalidKeyError, match="'bn/gamma' and 'bn/scale' both become it") as info:
        ws.remap({"bn/gamma": 1, "bn/scale": 2}, mapping=["*/gamma=*/scale"])
    assert info.value.key == "bn/scale"
    assert ws.remap({"bn/gamma": 1, "head/b": 2}, mapping=["*/gamma=*/scale"]) == {"bn/scale": 1, "head/b": 2}


def test_a_rule_for_the_ends_of_keys_and_a_scope_rule_both_apply():
    """The end first, then the scope: an EMA checkpoint read into a renamed top scope."""
    weights = {"net/w": 1, "net/w/ExponentialMovingAverage": 2, "net/b": 3, "step": 4}
    expected = {"model/w": 2, "model/b": 3, "step": 4}
    assert ws.remap(weights, mapping=["net=model", "*/ExponentialMovingAverage=*"]) == expected
    assert ws.remap(weights, mapping=["*/ExponentialMovingAverage=*", "net=model"]) == expected
    assert ws.remap({"net/w/ExponentialMovingAverage": 1}, mapping=["*/ExponentialMovingAverage=*/ema", "net/w=v"]
                    ) == {"v/ema": 1}
    with pytest.raises(ws.SelectionError, match=r"mapping \*/a/b=\* never applies: the earlier rule \*/b=\*"):
        ws.remap({"x/a/b": 1}, mapping=["*/b=*", "*/a/b=*"])
    assert ws.remap({"x/a/b": 1, "y/b": 2}, mapping=["*/a/b=*", "*/b=*/c"]) == {"x": 1, "y/c": 2}


def test_a_rule_for_the_ends_of_keys_that_matches_none_suggests_an_ending():
    with pytest.raises(ws.SelectionError, match=r"mapping \*/ExponentialMovingAverag=\* matches no key; "
                                                r"did you mean '\*/ExponentialMovingAverage'\?"):
        ws.remap({"net/w": 1, "net/w/ExponentialMovingAverage": 2}, mapping=["*/ExponentialMovingAverag=*"])


# -- the order rules, through real files ----------------------------------------------------------

@pytest.fixture(params=[".npz", ".h5"])
def ensemble(request, tmp_path):
    path = tmp_path / f"ensemble{request.param}"
    weights = {
        "model_1/dense/kernel": np.full((2, 2), 1.0),
        "model_1/dense/bias": np.full(2, 1.5),
        "model_1/head/w": np.full(3, 1.7),
        "model_10/dense/kernel": np.full((2, 2), 10.0),
        "model_2/dense/kernel": np.full((2, 2), 2.0),
        "shared/emb": np.arange(4.0),
    }
    ws.save(path, weights)
    return path, weights


def test_load_scope_keeps_whole_segments_and_strips(ensemble):
    path, weights = ensemble
    loaded = ws.load(path, scope="model_1")
    assert list(loaded) == ["dense/kernel", "dense/bias", "head/w"]
    assert np.array_equal(loaded["dense/kernel"], weights["model_1/dense/kernel"])


def test_load_include_is_relative_to_the_scope(ensemble):
    path, _ = ensemble
    assert list(ws.load(path, scope="model_1", include="dense")) == ["dense/kernel", "dense/bias"]
    assert list(ws.load(path, scope="model_1", include="*/kernel")) == ["dense/kernel"]
    assert list(ws.load(path, scope="model_1", exclude="dense")) == ["head/w"]
    with pytest.raises(ws.SelectionError):  # the full key is not what include sees under a scope
        ws.load(path, scope="model_1", include="model_1/dense")


def test_load_mapping_then_selection_on_mapped_keys(ensemble):
    path, weights = ensemble
    loaded = ws.load(path, mapping=["model_1=student", "model_2=teacher"], include=["student", "teacher"])
    assert list(loaded) == ["student/dense/kernel", "student/dense/bias", "student/head/w", "teacher/dense/kernel"]
    assert np.array_equal(loaded["teacher/dense/kernel"], weights["model_2/dense/kernel"])
    with pytest.raises(ws.SelectionError):
        ws.load(path, mapping="model_1=student", include="model_1")


def test_load_scope_and_mapping_together(ensemble):
    path, _ = ensemble
    rules = ["dense=layer_0", "=net"]
    assert list(ws.load(path, scope="model_1", mapping=rules)) == ["layer_0/kernel", "layer_0/bias", "net/head/w"]
    assert list(ws.load(path, scope="model_1", mapping=rules, include="net")) == ["net/head/w"]
    # '=TO' puts every key (not caught by an earlier rule) under TO
    assert list(ws.load(path, scope="model_1", mapping="=net")) == ["net/dense/kernel", "net/dense/bias", "net/head/w"]
    # 'FROM=' strips FROM
    assert list(ws.load(path, scope="model_1", mapping="dense=")) == ["kernel", "bias", "head/w"]


def test_load_scope_that_matches_nothing_suggests(ensemble):
    path, _ = ensemble
    with pytest.raises(ws.SelectionError) as info:
        ws.load(path, scope="model_01")
    message = str(info.value)
    assert str(path) in message and "model_01" in message and "did you mean 'model_1'" in message
    with pytest.raises(ws.SelectionError) as info:
        ws.load(path, scope="model_1", include="densee")
    assert str(path) in str(info.value) and "did you mean 'dense'" in str(info.value)
    with pytest.raises(ws.SelectionError):
        ws.load(path, exclude="*")


def test_load_include_without_scope(ensemble):
    path, _ = ensemble
    assert list(ws.load(path, include="model_1")) == ["model_1/dense/kernel", "model_1/dense/bias", "model_1/head/w"]
    assert list(ws.load(path, include="model_1*/dense/kernel")) == ["model_1/dense/kernel", "model_10/dense/kernel"]


def test_store_read_of_missing_key(ensemble):
    path, _ = ensemble
    with ws.open(path) as store:
        with pytest.raises(ws.KeyNotInStoreError) as info:
            store.read(["model_1/dense/kernel", "model_3/dense/kernel"])
        assert "model_3/dense/kernel" in str(info.value) and str(path) in str(info.value)
        assert set(store.read(["shared/emb"])) == {"shared/emb"}
        assert "model_2/dense/kernel" in store and "model_2" not in store


def test_scope_that_names_a_tensor_says_so(tmp_path):
    path = tmp_path / "w.npz"
    ws.save(path, {"w": np.zeros(1), "w/Adagrad": np.ones(1)})
    assert list(ws.load(path, scope="w")) == ["Adagrad"]  # the key equal to the scope has no relative name
    with pytest.raises(ws.SelectionError) as info:
        ws.load(path, scope="w/Adagrad")
    message = str(info.value)
    assert str(path) in message and "not a scope" in message and "include='w/Adagrad'" in message
    assert "did you mean 'w/Adagrad'" not in message
    assert list(ws.load(path, include="w/Adagrad")) == ["w/Adagrad"]


@pytest.mark.parametrize("exclude", ["", [""]])
def test_excluding_the_root_scope_keeps_nothing_and_says_so(exclude):
    """``""`` is the root scope, so it matches every key: as a string or in a list alike."""
    with pytest.raises(ws.SelectionError, match="keeps no key"):
        K.plan_outward(["a", "b/c"], exclude=exclude)
    assert K.plan_outward(["a", "b/c"], include="") == {"a": "a", "b/c": "b/c"}
