"""Every ``ws`` command, follower and rank starts a Python process that imports weightstore: the
import loads what the call uses, not the whole library (numpy alone is a fifth of a second), and
every public name still works as if the package had imported it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

HEAVY = ("numpy", "weightstore.store", "weightstore.sync._checks", "weightstore.sharded", "weightstore.adapters.layout")

LOADED = f"""
import atexit, sys
atexit.register(lambda: print(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""


def loaded(code: str, *args: str) -> str:
    """What ``code`` left imported of :data:`HEAVY`, printed as it exits."""
    done = subprocess.run([sys.executable, "-c", LOADED + code, *args], capture_output=True, text=True, timeout=120)
    return done.stdout.splitlines()[-1]


def test_import_weightstore_loads_neither_numpy_nor_the_layers():
    assert loaded("import weightstore as ws; ws.WeightStoreError, ws.__version__") == "[]"


def test_ws_version_and_help_load_no_numpy():
    """As the ``ws`` script runs them; ``ws ls`` then loads only what reads a file, no publisher."""
    ws = "import sys; from weightstore.cli.main import main; sys.argv = ['ws', *sys.argv[1:]]; main()"
    assert loaded(ws, "--version") == "[]"
    assert loaded(ws, "--help") == "[]"
    assert loaded(ws, "follow", "--help") == "[]"


def test_ws_ls_loads_no_publisher_nor_sharded_versions(tmp_path):
    import weightstore as ws

    ws.save(tmp_path / "small.npz", {"a": np.ones(3, np.float32)})
    code = ("import sys; from weightstore.cli.main import main; sys.argv = ['ws', 'ls', sys.argv[1]]\n"
            "try:\n    main()\nfinally:\n"
            "    assert 'weightstore.sync._background' not in sys.modules, 'the publisher'\n")
    assert loaded(code, str(tmp_path / "small.npz")) == "['numpy', 'weightstore.store']"


def test_public_names_imported_on_first_use_are_the_modules_own(tmp_path):
    """``from weightstore import X``, ``ws.X``, ``ws.sync.X``, ``dir()`` and pickling, each in a
    fresh process that has imported nothing else."""
    code = """
import pickle, sys
import weightstore as ws
from weightstore import BackgroundPublisher, publish, publish_shard
from weightstore.sync import list_versions
from weightstore.sharded import _shards
from weightstore.sync import _background, _listing, _publish

assert publish is ws.publish is _publish.publish and BackgroundPublisher is _background.BackgroundPublisher
assert publish_shard is _shards.publish_shard and list_versions is _listing.list_versions
assert set(ws.__all__) <= set(dir(ws)) and set(ws.sync.__all__) <= set(dir(ws.sync))
assert {"sync", "sharded", "store"} <= set(dir(ws))
assert not {"functools", "TYPE_CHECKING"} & (set(dir(ws)) | set(dir(ws.sync)))  # what building them needed
assert pickle.loads(pickle.dumps((ws.Delta, ws.save, ws.TensorInfo))) == (ws.Delta, ws.save, ws.TensorInfo)
ws.save(sys.argv[1], {"a": [1.0, 2.0]})
assert ws.load(sys.argv[1])["a"].tolist() == [1.0, 2.0]
try:
    ws.no_such_name
except AttributeError as e:
    assert "no attribute 'no_such_name'" in str(e), e
else:
    raise AssertionError("ws.no_such_name")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.npz")], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout == "ok\n", done.stderr


def test_a_moved_path_still_warns_at_the_callers_line():
    code = """
import warnings
import weightstore as ws
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ws.cluster
print(caught[0].category.__name__, caught[0].lineno, ws.cluster.__name__)
"""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "DeprecationWarning 6 weightstore.sharded._cluster\n", done.stderr


def test_a_layers_modules_are_reached_as_attributes_after_a_plain_import():
    """``import weightstore`` used to import every layer, so ``ws.io.objects.PART_BYTES`` (the
    part size docs/object-storage.md names) was there to read or set; each layer's submodules are
    now imported on first use, whatever an earlier call happened to import, and ``dir()`` lists them."""
    code = """
import weightstore as ws
assert ws.io.objects.PART_BYTES > 0 and ws.io.commit.UPLOAD_PART_BYTES > 0
assert ws.io.backends.register and ws.core.keys.remap is ws.remap and ws.formats.delta.FORMAT
assert ws.sync._publish.publish is ws.publish and ws.store._save.save is ws.save and ws.sharded._shards
assert {"objects", "location"} <= set(dir(ws.io)) and "_publish" in dir(ws.sync)
for missing in ("no_such_module", "__wrapped__"):
    assert not hasattr(ws.io, missing)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "ok\n", done.stderr
