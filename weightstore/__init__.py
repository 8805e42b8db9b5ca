"""weightstore: model weights in files any framework can read, moved under any scope.

The core never imports TensorFlow; ``weightstore.adapters`` does, on demand.
"""

__version__ = "0.1.0"

from weightstore import errors  # noqa: E402
from weightstore.background import BackgroundPublisher  # noqa: E402
from weightstore.errors import *  # noqa: E402,F401,F403
from weightstore.keys import remap, select  # noqa: E402
from weightstore.manifest import TensorInfo  # noqa: E402
from weightstore.saving import save  # noqa: E402
from weightstore.shards import Piece, commit_shards, publish_shard  # noqa: E402
from weightstore.store import Store, load, open  # noqa: E402,A004
from weightstore.versions import Version, follow, latest, publish  # noqa: E402

__all__ = ["__version__", "load", "open", "remap", "save", "select", "Store", "TensorInfo",
           "publish", "latest", "follow", "Version",
           "Piece", "publish_shard", "commit_shards", "BackgroundPublisher", *errors.__all__]
