"""The import paths of modules this release moved, kept working for one release.

The tree was reorganised into layers (``core/``, ``store/``, ``sync/``, ``sharded/``,
``adapters/serving/``), and the internals of ``io/``, ``formats/`` and ``adapters/`` were marked
private (``weightstore.formats.zipdir`` is now ``weightstore.formats._zipdir``). A program that
imports an old path, such as ``weightstore.keys`` or ``weightstore.adapters.hooks``, gets the
module that now holds that code (the same module object, so its names and their state are
shared) and a ``DeprecationWarning`` naming it. One table, one finder: no file is left behind at
the old places. What this keeps is the documented names: a module that was split
(``weightstore.versions`` is now several modules of ``weightstore.sync``) maps to the package
whose ``__init__`` lists its public names, not to its private helpers, which moved to the split
modules.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

#: old module path -> the module that holds its code now
MOVED = {
    "weightstore.keys": "weightstore.core.keys",
    "weightstore.manifest": "weightstore.core.manifest",
    "weightstore.names": "weightstore.core.names",
    "weightstore.crc": "weightstore.core.checksums",
    "weightstore.heap": "weightstore.core._heap",
    "weightstore.extras": "weightstore.core._extras",
    "weightstore.saving": "weightstore.store._save",
    "weightstore.versions": "weightstore.sync",
    "weightstore.notify": "weightstore.sync._notify",
    "weightstore.background": "weightstore.sync._background",
    "weightstore.shards": "weightstore.sharded._shards",
    "weightstore.cluster": "weightstore.sharded._cluster",
    "weightstore.shardindex": "weightstore.formats._sharded_index",
    "weightstore.adapters.follower": "weightstore.adapters.serving.follower",
    "weightstore.adapters.hooks": "weightstore.adapters.serving.hooks",
    "weightstore.adapters.snapshot": "weightstore.adapters.serving.snapshot",
    # internals marked private (a leading _): the old paths were importable, so they keep working
    "weightstore.adapters.artifacts": "weightstore.adapters._artifacts",
    "weightstore.adapters.checkpoints": "weightstore.adapters._checkpoints",
    "weightstore.adapters.keras_config": "weightstore.adapters._keras_config",
    "weightstore.adapters.keras_import": "weightstore.adapters._keras_import",
    "weightstore.adapters.layer_rules": "weightstore.adapters._layer_rules",
    "weightstore.adapters.tf1_callables": "weightstore.adapters._tf1_callables",
    "weightstore.adapters.tf1_training": "weightstore.adapters._tf1_training",
    "weightstore.adapters.tf2_sharded": "weightstore.adapters._tf2_sharded",
    "weightstore.adapters.tf_staging": "weightstore.adapters._tf_staging",
    "weightstore.adapters.torch_shards": "weightstore.adapters._torch_shards",
    "weightstore.formats.foreign": "weightstore.formats._foreign",
    "weightstore.formats.hdf5_bytes": "weightstore.formats._hdf5_bytes",
    "weightstore.formats.renamed": "weightstore.formats._renamed",
    "weightstore.formats.shuffle_zstd": "weightstore.formats._shuffle_zstd",
    "weightstore.formats.sstable": "weightstore.formats._sstable",
    "weightstore.formats.tf_protos": "weightstore.formats._tf_protos",
    "weightstore.formats.zipdir": "weightstore.formats._zipdir",
    "weightstore.io.buffer": "weightstore.io._buffer",
    "weightstore.io.local": "weightstore.io._local",
    "weightstore.io.ranges": "weightstore.io._ranges",
    "weightstore.io.writeback": "weightstore.io._writeback",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module now at the new one."""

    def __init__(self, new: str):
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module was imported at its own path): its own spec is put back,
        which the import system replaced with the old path's."""
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED`, after every real module has been looked for."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def attribute(package: str, name: str) -> ModuleType:
    """``package.name`` where it is a moved module (``ws.cluster`` after ``import weightstore``),
    imported through its old path so that it warns the same way."""
    old = f"{package}.{name}"
    if old not in MOVED:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(f"{old} moved to {MOVED[old]}; the old path goes in the next release", DeprecationWarning,
                  stacklevel=3)  # the caller of the package's __getattr__
    with warnings.catch_warnings():  # said once, at the caller's line
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(old)


def install() -> None:
    """Adds the finder once (at the end of ``sys.meta_path``: real modules win)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
