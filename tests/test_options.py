"""The selection and assign words are one list, taken alike by every adapter, the follower, the hooks and the CLI."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from weightstore.adapters.plan import AssignOptions, AssignWords, Selection, SelectionWords

ADAPTERS = ("tf1", "tf2", "torch", "flax")
#: words one framework has and others lack; every other word must be a shared one
OWN_WORDS = {"layout", "optimizer", "names"}  # layout and names: how a framework lays tensors out and names them
SELECTION = {field.name for field in dataclasses.fields(Selection)}
ASSIGN = {field.name for field in dataclasses.fields(AssignOptions)}


def words(function: typing.Callable) -> set[str]:
    """The keyword arguments ``function`` takes: its keyword-only parameters and those its ``**`` unpacks."""
    found = set()
    for parameter in inspect.signature(function, eval_str=True).parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY:
            found.add(parameter.name)
        elif parameter.kind is parameter.VAR_KEYWORD:
            (typed,) = typing.get_args(parameter.annotation)
            found |= set(typing.get_type_hints(typed))
    return found


def test_the_typed_words_are_the_options_fields_with_their_types():
    assert typing.get_type_hints(SelectionWords) == typing.get_type_hints(Selection)
    assert typing.get_type_hints(AssignWords) == typing.get_type_hints(AssignOptions)


def test_every_adapter_export_and_assign_take_the_same_words():
    modules = {name: pytest.importorskip(f"weightstore.adapters.{name}") for name in ADAPTERS}
    for name, module in modules.items():
        exported, assigned = words(module.export), words(module.assign)
        assert exported >= SELECTION and exported - SELECTION <= OWN_WORDS, name
        assert assigned >= ASSIGN and assigned - ASSIGN <= OWN_WORDS, name


def test_the_follower_hooks_and_cli_take_the_same_words():
    pytest.importorskip("tensorflow")
    from weightstore.adapters.serving import follower, hooks
    from weightstore.cli import main

    assert words(follower.Follower) >= ASSIGN
    assert words(hooks.PublishCallback) >= SELECTION and words(hooks.PublishHook) >= SELECTION
    assert SELECTION | {"mapping"} <= set(inspect.signature(main.export).parameters)


def _exporter(name: str) -> typing.Callable[..., dict]:
    """``export`` of one adapter over a small model of its framework: a trainable weight and a
    statistic that is not (``net/w``, ``net/stat``), with the words passed through."""
    if name == "tf2":
        tf = pytest.importorskip("tensorflow")
        from weightstore.adapters import tf2

        module = tf.Module(name="net")
        module.w, module.stat = tf.Variable(tf.ones(2)), tf.Variable(tf.zeros(2), trainable=False)
        return lambda **words: tf2.export({"net/w": module.w, "net/stat": module.stat}, **words)
    if name == "tf1":
        tf = pytest.importorskip("tensorflow")
        from weightstore.adapters import tf1

        graph = tf.Graph()
        with graph.as_default(), tf.compat.v1.variable_scope("net"):
            tf.compat.v1.get_variable("w", [2])
            tf.compat.v1.get_variable("stat", [2], trainable=False)
            init = tf.compat.v1.global_variables_initializer()
        session = tf.compat.v1.Session(graph=graph)
        session.run(init)
        return lambda **words: tf1.export(session, **words)
    if name == "torch":
        torch = pytest.importorskip("torch")
        from weightstore.adapters import torch as torch_adapter

        net = torch.nn.Module()
        net.w = torch.nn.Parameter(torch.ones(2))
        net.register_buffer("stat", torch.zeros(2))
        holder = torch.nn.Module()
        holder.net = net
        return lambda **words: torch_adapter.export(holder, **words)
    pytest.importorskip("flax")
    import numpy as np
    from flax import nnx

    from weightstore.adapters import flax as flax_adapter

    class Net(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.ones(2, np.float32))
            self.stat = nnx.BatchStat(np.zeros(2, np.float32))

    class Holder(nnx.Module):
        def __init__(self):
            self.net = Net()

    holder = Holder()
    return lambda **words: flax_adapter.export(holder, **words)


@pytest.mark.parametrize("name", ADAPTERS)
def test_every_adapter_applies_the_selection_words_alike(name):
    """The same words keep the same keys in every framework, and each refuses the same mistakes."""
    from weightstore.errors import SelectionError

    export = _exporter(name)
    assert sorted(export()) == ["net/stat", "net/w"]
    assert sorted(export(trainable_only=True)) == ["net/w"]
    assert sorted(export(trainable_only=True, also="*/stat")) == ["net/stat", "net/w"]
    assert sorted(export(scope="net", exclude="w")) == ["stat"]
    with pytest.raises(SelectionError, match=r"also '\*/no_such' matches no key"):
        export(trainable_only=True, also="*/no_such")
    with pytest.raises(SelectionError, match="trainable_only keeps nothing"):
        export(include="*/stat", trainable_only=True)


def test_every_publisher_and_follower_shares_one_set_of_defaults():
    """keep, format and poll are declared once (weightstore.sync._versions), and every entry point has them."""
    pytest.importorskip("tensorflow")
    import weightstore as ws
    from weightstore.adapters import tf2
    from weightstore.adapters.serving import follower, hooks
    from weightstore.cli import sync
    from weightstore.sharded import _shards as shards
    from weightstore.sync import _background as background
    from weightstore.sync import _versions as versions

    def default(function: typing.Callable, name: str) -> object:
        return inspect.signature(function).parameters[name].default

    for publisher in (ws.publish, background.BackgroundPublisher, hooks.PublishCallback, hooks.PublishHook,
                      shards.commit_shards, tf2.publish_sharded):
        assert default(publisher, "keep") == versions.DEFAULT_KEEP, publisher
    for publisher in (ws.publish, background.BackgroundPublisher, hooks.PublishCallback, hooks.PublishHook):
        assert default(publisher, "format") == versions.DEFAULT_FORMAT, publisher
    for looker in (ws.follow, follower.Follower, sync.follow):
        assert default(looker, "poll") == versions.DEFAULT_POLL, looker
