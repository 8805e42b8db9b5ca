"""Without an optional extra, what needs it says which extra to install, in Python and in ``ws``.

The cases run in a fresh interpreter whose ``sys.modules`` holds ``None`` for every optional
framework, which makes importing them fail exactly as if they were not installed (one
interpreter for all of them: starting one costs seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

import weightstore
from weightstore.core._extras import install_hint

OPTIONAL = ["tensorflow", "keras", "torch", "jax", "flax", "s3fs"]
#: adapter -> (the modules it may name first, its extra)
ADAPTERS = {"torch": (["torch"], "torch"), "flax": (["jax", "flax"], "flax"), "tf1": (["tensorflow"], "tf"),
            "tf2": (["keras", "tensorflow"], "tf"), "serving.hooks": (["keras", "tensorflow"], "tf"),
            "serving.snapshot": (["keras", "tensorflow"], "tf")}
ATTEMPTS = f"""
import importlib, json
import weightstore
from weightstore.errors import MissingDependencyError

def attempt(action):
    try:
        action()
    except ImportError as exc:
        return [type(exc).__name__, isinstance(exc, MissingDependencyError), getattr(exc, "path", None), str(exc)]

for name in {list(ADAPTERS)!r}:
    print(json.dumps([name, attempt(lambda: importlib.import_module("weightstore.adapters." + name))]))
print(json.dumps(["s3", attempt(lambda: weightstore.open("s3://bucket/m.npz"))]))
"""


def run_without_extras(code: str) -> subprocess.CompletedProcess:
    prelude = f"import sys\nfor name in {OPTIONAL!r}:\n    sys.modules[name] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)


def test_adapters_and_s3_urls_without_their_extra_raise_missing_dependency_naming_it():
    done = run_without_extras(ATTEMPTS)
    results = dict(json.loads(line) for line in done.stdout.splitlines())
    assert set(results) == {*ADAPTERS, "s3"}, done.stderr
    for adapter, (modules, extra) in ADAPTERS.items():
        kind, is_ours, path, message = results[adapter]
        assert (kind, is_ours, path) == ("MissingDependencyError", True, None), adapter
        assert any(f"weightstore.adapters.{adapter} needs {name}," in message for name in modules), message
        assert install_hint(extra) in message
    kind, is_ours, path, message = results["s3"]
    assert (kind, is_ours, path) == ("MissingDependencyError", True, "s3://bucket/m.npz")
    assert message.startswith("s3://bucket/m.npz: s3:// URLs need s3fs") and install_hint("s3") in message


def test_ws_prints_the_missing_extra_as_its_one_error_line():
    done = run_without_extras("import runpy\nsys.argv = ['ws', 'ls', 's3://bucket/m.npz']\n"
                              "runpy.run_module('weightstore', run_name='__main__')")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"error: s3://bucket/m.npz: s3:// URLs need s3fs, which is not "
                                                f"installed: {install_hint('s3')}"]


def test_the_hint_installs_from_the_clone_since_weightstore_is_not_on_pypi():
    for extra in ("tf", "torch", "flax", "s3"):
        hint = install_hint(extra)
        assert f'pip install ".[{extra}]"' in hint and "weightstore[" not in hint


def test_ws_says_which_of_its_steps_needs_tensorflow(tmp_path):
    """The core reads TF checkpoints without TensorFlow; writing one is what needs it, and the line says so."""
    source, target = tmp_path / "m.npz", tmp_path / "new.ckpt"
    weightstore.save(source, {"w": np.ones(3, np.float32)})
    done = run_without_extras(f"import runpy\nsys.argv = ['ws', 'import', {str(source)!r}, '--into', {str(target)!r}]\n"
                              "runpy.run_module('weightstore', run_name='__main__')")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"error: {target}: writing a TensorFlow checkpoint needs TensorFlow: "
                                                f"{install_hint('tf')}"]
    assert not os.path.exists(f"{target}.index")
