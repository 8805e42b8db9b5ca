"""weightstore: model weights in files any framework can read, moved under any scope.

The core never imports TensorFlow; ``weightstore.adapters`` does, on demand. The layers, lowest
first: ``errors``; ``core`` (keys, manifest, checksums); ``io``; ``formats``; ``store`` (one
file); ``sync`` (versions of a model, job 1) and ``sharded`` (many writers, one version);
``adapters`` (frameworks); ``cli`` (the ``ws`` command). Importing the package imports the
errors only: each other public name, and each layer, is imported on first use
(:mod:`weightstore._lazy`).
"""

import functools
import sys
from typing import TYPE_CHECKING

if sys.argv[:1] == ["-m"]:  # Python is importing this package to run a module with -m: which?
    import _weightstore_cli

    _weightstore_cli.starting_as_module()  # ``python -m weightstore``: Ctrl-C now exits 130 quietly, as ``ws``

# ``threading``'s exit hooks run in reverse order of registration: weightstore's (the exit waits
# for the background publishes under way, ``_exiting``) is registered at ``import weightstore``,
# as ever, so a hook a program registers after this import runs before that wait
from weightstore import _lazy, _moved, errors
from weightstore._version import __version__
from weightstore.core import _exiting  # noqa: F401
from weightstore.errors import *  # noqa: F401,F403

if TYPE_CHECKING:
    from weightstore.core.keys import remap, select
    from weightstore.core.manifest import TensorInfo
    from weightstore.sharded import Piece, commit_shards, publish_shard
    from weightstore.store import Store, load, open, save  # noqa: A004
    from weightstore.sync import BackgroundPublisher, Delta, Version, follow, latest, publish

_moved.install()

__getattr__, __dir__ = _lazy.on_first_use(globals(), {
    **dict.fromkeys(["remap", "select"], "weightstore.core.keys"),
    "TensorInfo": "weightstore.core.manifest",
    **dict.fromkeys(["Store", "load", "open", "save"], "weightstore.store"),
    **dict.fromkeys(["publish", "latest", "follow", "Version", "BackgroundPublisher", "Delta"], "weightstore.sync"),
    **dict.fromkeys(["Piece", "publish_shard", "commit_shards"], "weightstore.sharded"),
}, modules=["core", "io", "formats", "store", "sync", "sharded"], otherwise=functools.partial(_moved.attribute, __name__))
del functools, TYPE_CHECKING  # what building the package needed is no name of it (dir(weightstore))

__all__ = ["__version__", "load", "open", "remap", "save", "select", "Store", "TensorInfo",
           "publish", "latest", "follow", "Version",
           "Piece", "publish_shard", "commit_shards", "BackgroundPublisher", "Delta", *errors.__all__]
