"""The selection and assign words are one list, taken alike by every adapter, the follower, the hooks and the CLI;
and every adapter offers the same verbs."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

import pytest

from weightstore.adapters.plan import AssignOptions, AssignWords, Selection, SelectionWords

ADAPTERS = ("tf1", "tf2", "torch", "flax")
#: words one framework has and others lack; every other word must be a shared one
OWN_WORDS = {"layout", "optimizer", "names"}  # layout and names: how a framework lays tensors out and names them
#: which share of a sharded version this process writes, where the framework does not say itself
PIECE_WORDS = {"rank", "world"}
VERBS = ("export", "export_pieces", "assign", "variables", "forget")
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


def test_every_adapter_has_every_verb_with_the_shared_selection_words():
    """``export``, ``export_pieces``, ``assign``, ``variables`` and ``forget`` in each framework
    module, reading ``**selection`` (or ``**words``) alike; framework-only extras are beside them."""
    modules = {name: pytest.importorskip(f"weightstore.adapters.{name}") for name in ADAPTERS}
    for name, module in modules.items():
        assert set(VERBS) <= set(module.__all__), name
        for verb in ("export", "export_pieces", "variables"):
            taken = words(getattr(module, verb))
            assert taken >= SELECTION and taken - SELECTION <= OWN_WORDS | PIECE_WORDS, (name, verb)
        assert words(module.assign) >= ASSIGN, name
        assert len(inspect.signature(module.forget).parameters) == 1, name
    assert words(modules["torch"].tensors) == words(modules["torch"].variables)  # the name earlier releases used


def test_the_follower_hooks_and_cli_take_the_same_words():
    pytest.importorskip("tensorflow")
    from weightstore.adapters.serving import follower, hooks
    from weightstore.cli import main

    assert words(follower.Follower) >= ASSIGN
    assert words(hooks.PublishCallback) >= SELECTION and words(hooks.PublishHook) >= SELECTION
    assert SELECTION | {"mapping"} <= set(inspect.signature(main.export).parameters)


def _model(name: str) -> tuple[typing.Any, typing.Any, typing.Any]:
    """One adapter, a small model of its framework with a trainable weight and a statistic that
    is not (``net/w``, ``net/stat``), and the framework's own object holding ``net/w``."""
    if name == "tf2":
        tf = pytest.importorskip("tensorflow")
        from weightstore.adapters import tf2

        module = tf.Module(name="net")
        module.w, module.stat = tf.Variable(tf.ones(2)), tf.Variable(tf.zeros(2), trainable=False)
        return tf2, {"net/w": module.w, "net/stat": module.stat}, module.w
    if name == "tf1":
        tf = pytest.importorskip("tensorflow")
        from weightstore.adapters import tf1

        graph = tf.Graph()
        with graph.as_default(), tf.compat.v1.variable_scope("net"):
            w = tf.compat.v1.get_variable("w", [2])
            tf.compat.v1.get_variable("stat", [2], trainable=False)
            init = tf.compat.v1.global_variables_initializer()
        session = tf.compat.v1.Session(graph=graph)
        session.run(init)
        return tf1, session, w
    if name == "torch":
        torch = pytest.importorskip("torch")
        from weightstore.adapters import torch as torch_adapter

        net = torch.nn.Module()
        net.w = torch.nn.Parameter(torch.ones(2))
        net.register_buffer("stat", torch.zeros(2))
        holder = torch.nn.Module()
        holder.net = net
        return torch_adapter, holder, net.w
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
    return flax_adapter, holder, holder.net.w


def _exporter(name: str) -> typing.Callable[..., dict]:
    """``export`` of one adapter over :func:`_model`'s model, with the words passed through."""
    adapter, model, _ = _model(name)
    return lambda **words: adapter.export(model, **words)


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


@pytest.mark.parametrize("name", ADAPTERS)
def test_every_adapter_variables_are_what_its_export_reads_and_its_pieces_hold(name):
    """``variables`` keys what ``export`` keys under the same words, each the framework's own
    object; ``export_pieces`` of one process holds every exported tensor, whole."""
    import numpy as np

    adapter, model, w = _model(name)
    for chosen_by in ({}, {"trainable_only": True}, {"trainable_only": True, "also": "*/stat"},
                      {"scope": "net", "exclude": "w"}, {"include": "net/w"}):
        assert sorted(adapter.variables(model, **chosen_by)) == sorted(adapter.export(model, **chosen_by)), chosen_by
    assert adapter.variables(model)["net/w"] is w
    if name == "torch":  # the alias keeps the name earlier releases used
        assert {key: id(t) for key, t in adapter.tensors(model).items()} == {
            key: id(t) for key, t in adapter.variables(model).items()}
    exported, pieces = adapter.export(model), adapter.export_pieces(model)
    assert sorted(pieces) == sorted(exported)
    for key, (piece,) in pieces.items():
        assert piece.start == (0,) and np.asarray(piece.array).tobytes() == exported[key].tobytes(), key


@pytest.mark.parametrize("name", ADAPTERS)
def test_a_word_no_verb_takes_is_a_type_error_naming_the_verb_called_with_a_close_match(name):
    """``tf2.assign(model, path, scop="x")`` names ``tf2.assign`` and suggests ``scope``, not the
    options class the words go into; a word like no other gets no suggestion."""
    import numpy as np

    adapter, model, _ = _model(name)
    calls = {"assign": lambda **words: adapter.assign(model, {"net/w": np.ones(2, np.float32)}, **words),
             "export": lambda **words: adapter.export(model, **words),
             "export_pieces": lambda **words: adapter.export_pieces(model, **words),
             "variables": lambda **words: adapter.variables(model, **words)}
    for verb, call in calls.items():
        with pytest.raises(TypeError, match=fr"^{name}\.{verb}\(\) got an unexpected keyword argument 'scop'; "
                                            r"did you mean 'scope'\?$"):
            call(scop="net")
        with pytest.raises(TypeError, match=fr"^{name}\.{verb}\(\) got an unexpected keyword argument 'bogus'$"):
            call(bogus=1)
    with pytest.raises(TypeError, match=fr"^{name}\.assign\(\) .* 'strickt'; did you mean 'strict'\?$"):
        calls["assign"](strickt=False)
    from weightstore.adapters.serving.follower import Follower

    with pytest.raises(TypeError, match=r"^Follower\(\) got an unexpected keyword argument 'scop'; did you mean"):
        Follower(model, "versions", scop="net")


#: per adapter, a verb and a typo of a parameter of its own (not an option word), which Python
#: hands to its ``**words`` as it takes any keyword it does not bind
OWN_TYPOS = {"tf1": [("assign", "optimzer", "optimizer")],
             "tf2": [("assign", "optimzer", "optimizer"), ("export", "optimzer", "optimizer"),
                     ("export_pieces", "wrld", "world"), ("publish_sharded", "timout", "timeout")],
             "torch": [("assign", "layot", "layout"), ("export", "layot", "layout"),
                       ("export_pieces", "rnak", "rank"), ("publish_sharded", "timout", "timeout")],
             "flax": [("assign", "layot", "layout"), ("export", "layot", "layout"),
                      ("publish_sharded", "timout", "timeout")]}


@pytest.mark.parametrize("name", ADAPTERS)
def test_a_typo_of_a_verb_s_own_parameter_gets_a_close_match_too(name, tmp_path):
    """``tf2.assign(model, path, optimzer=True)``: ``optimizer`` is ``tf2.assign``'s own
    parameter, not an option word, and was no close match; nor ``Follower(..., pol=1)``'s
    ``poll``. Nothing is written."""
    import numpy as np

    adapter, model, _ = _model(name)
    for verb, typo, meant in OWN_TYPOS[name]:
        arguments = {"assign": (model, {"net/w": np.ones(2, np.float32)}),
                     "publish_sharded": (tmp_path / "run", model)}.get(verb, (model,))
        required = {"step": 1, "strategy": None} if verb == "publish_sharded" and name == "tf2" else (
            {"step": 1} if verb == "publish_sharded" else {})
        with pytest.raises(TypeError, match=fr"^{name}\.{verb}\(\) got an unexpected keyword argument {typo!r}; "
                                            fr"did you mean {meant!r}\?$"):
            getattr(adapter, verb)(*arguments, **required, **{typo: 1})
    assert not (tmp_path / "run").exists()
    from weightstore.adapters.serving.follower import Follower

    with pytest.raises(TypeError, match=r"^Follower\(\) got an unexpected keyword argument 'pol'; did you mean 'poll'\?$"):
        Follower(model, tmp_path / "run", pol=1)


def test_a_word_no_store_verb_takes_is_a_type_error_naming_the_verb_with_a_close_match(tmp_path):
    import numpy as np

    import weightstore as ws

    path, weights = tmp_path / "w.npz", {"w": np.ones(2)}
    ws.save(path, weights)
    calls = {"ws.save": lambda **words: ws.save(path, weights, **words),
             "ws.load": lambda **words: ws.load(path, **words),
             "ws.open": lambda **words: ws.open(path, **words),
             "ws.publish": lambda **words: ws.publish(tmp_path / "versions", weights, step=1, **words),
             "ws.follow": lambda **words: ws.follow(tmp_path / "versions", **words)}
    for called, call in calls.items():
        with pytest.raises(TypeError, match=fr"^{re.escape(called)}\(\) got an unexpected keyword argument 'bogus'$"):
            call(bogus=1)
    with pytest.raises(TypeError, match=r"^ws\.load\(\) got an unexpected keyword argument 'scop'; did you mean 'scope'\?$"):
        ws.load(path, scop="x")
    with pytest.raises(TypeError, match=r"'metdata'; did you mean 'metadata'\?$"):
        ws.publish(tmp_path / "versions", weights, step=1, metdata={})
    assert not (tmp_path / "versions").exists()  # refused before anything was written


@pytest.mark.parametrize("name", ADAPTERS)
def test_adapter_for_finds_each_framework_s_adapter(name):
    from weightstore.adapters import adapter_for

    adapter, model, _ = _model(name)
    assert adapter_for(model) is adapter


def test_adapter_for_decides_by_the_type_s_bases_and_a_container_s_first_leaf(tmp_path):
    """A subclass defined outside its framework is its framework's; TF's sessions (wrapped or not,
    by a wrapper TF defines elsewhere) are TF1's, TF's other objects TF2's; a Flax Linen tree (a
    FrozenDict, or a dict of JAX arrays) is Flax's."""
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    pytest.importorskip("flax")
    import jax.numpy as jnp
    from flax.core import FrozenDict
    from tensorflow.python import debug as tf_debug

    from weightstore.adapters import adapter_for, flax, tf1, tf2

    class Model(keras.Model):  # defined here, in a test module: its bases say Keras
        pass

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.get_variable("w", [2])
        monitored = tf.compat.v1.train.MonitoredSession()
    try:
        session = tf.compat.v1.Session(graph=graph)
        assert adapter_for(monitored) is tf1 and adapter_for(session) is tf1
        assert adapter_for(tf_debug.DumpingDebugWrapperSession(session, str(tmp_path))) is tf1
    finally:
        monitored.close()
    assert adapter_for(Model()) is tf2 and adapter_for(tf.Module()) is tf2 and adapter_for([tf.Variable(1.0)]) is tf2
    sharded = tf.__internal__.distribute.ShardedVariable([tf.Variable([1.0]), tf.Variable([2.0])])
    assert adapter_for({"table": sharded}) is tf2
    assert adapter_for(FrozenDict({"params": {"w": jnp.ones(2)}})) is flax
    assert adapter_for({"params": {"Dense_0": {"kernel": jnp.ones(2)}}}) is flax


def test_every_publisher_and_follower_shares_one_set_of_defaults():
    """keep, format and poll are declared once (weightstore.sync._defaults), and every entry point has them."""
    pytest.importorskip("tensorflow")
    import weightstore as ws
    from weightstore.adapters import tf2
    from weightstore.adapters.serving import follower, hooks
    from weightstore.cli import sync
    from weightstore.sharded import _shards as shards
    from weightstore.sync import _background as background
    from weightstore.sync import _defaults

    def default(function: typing.Callable, name: str) -> object:
        return inspect.signature(function).parameters[name].default

    for publisher in (ws.publish, background.BackgroundPublisher, hooks.PublishCallback, hooks.PublishHook,
                      shards.commit_shards, tf2.publish_sharded):
        assert default(publisher, "keep") == _defaults.DEFAULT_KEEP, publisher
    for publisher in (ws.publish, background.BackgroundPublisher, hooks.PublishCallback, hooks.PublishHook):
        assert default(publisher, "format") == _defaults.DEFAULT_FORMAT, publisher
    for looker in (ws.follow, follower.Follower, sync.follow):
        assert default(looker, "poll") == _defaults.DEFAULT_POLL, looker
