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
    from weightstore.adapters import follower, hooks
    from weightstore.cli import main

    assert words(follower.Follower) >= ASSIGN
    assert words(hooks.PublishCallback) >= SELECTION and words(hooks.PublishHook) >= SELECTION
    assert SELECTION | {"mapping"} <= set(inspect.signature(main.export).parameters)
