"""The tree's layers, lowest first: no module imports a higher layer, not even inside a function.

The order is the one ``docs/design.md`` draws: errors < core < io < formats < store < sync <
sharded < the ``weightstore`` package's own names < adapters < cli. A module may import its own
layer and any below. Read from the source (``ast``), so a lazy import counts like any other.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: module prefixes, lowest layer first; a module belongs to the longest prefix it starts with
LAYERS = [
    ["weightstore.errors", "weightstore._version", "weightstore._moved", "weightstore._lazy"],
    ["weightstore.core"],
    ["weightstore.io"],
    ["weightstore.formats"],
    ["weightstore.store"],
    ["weightstore.sync"],
    ["weightstore.sharded"],
    ["weightstore"],
    ["weightstore.adapters"],
    ["weightstore.cli", "weightstore.__main__"],
]


def modules() -> dict[str, Path]:
    """Every module of the distribution, by its dotted name (``adapters/`` is ``weightstore.adapters``)."""
    found = {}
    for folder, package in (("weightstore", "weightstore"), ("adapters", "weightstore.adapters"),
                            ("cli", "weightstore.cli")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if folder == "weightstore" and parts[0] in ("adapters", "cli"):
                continue  # the links that make adapters/ and cli/ part of the package
            found[".".join((package, *(p for p in parts if p != "__init__")))] = path
    return found


def layer(module: str) -> int:
    best, rank = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank >= 0, f"{module} is in no layer: add it to LAYERS and to docs/design.md"
    return rank


def imported(name: str, path: Path) -> set[str]:
    """The weightstore modules ``path`` imports anywhere in it (``from pkg import mod`` counts as ``pkg.mod``)."""
    tree = ast.parse(path.read_text(), str(path))
    known = modules()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
    return {module for module in found if module == "weightstore" or module.startswith("weightstore.")}


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_imports_a_higher_layer(name):
    path = modules()[name]
    higher = sorted(m for m in imported(name, path) if layer(m) > layer(name))
    assert not higher, f"{path.relative_to(ROOT)} (layer {layer(name)}) imports higher layers: {higher}"


def test_the_layers_cover_the_tree():
    assert {layer(name) for name in modules()} == set(range(len(LAYERS)))


def test_the_import_paths_this_release_moved_still_give_the_same_modules_with_a_warning():
    code = """
import importlib, warnings
from weightstore._moved import MOVED
import importlib.util
for old, new in MOVED.items():
    if "serving" in new or new.rsplit(".", 1)[1] in ("_tf1_callables", "_tf_staging", "_tf2_sharded", "_torch_shards"):
        # those import a framework: found, not imported (their paths are the same mechanism)
        assert importlib.util.find_spec(old).loader.new == new and importlib.util.find_spec(new), old
        continue
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new), old
    assert module.__spec__.name == new, old
    assert any(issubclass(w.category, DeprecationWarning) and old in str(w.message) for w in caught), old
import weightstore as ws
assert ws.cluster.membership is ws.sharded.membership
from weightstore.versions import publish
assert publish is ws.publish
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
