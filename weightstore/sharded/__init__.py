"""Many writers, one version: every rank of a job writes its own pieces, one commits.

Each rank writes an ordinary weightstore file of its pieces plus a small done-record
(:func:`publish_shard`); the coordinator checks that the pieces tile every tensor, writes the
version's index and then ``LATEST`` (:func:`commit_shards`). Membership (rank, world) comes
from the job's own cluster (:func:`membership`); the attempt and the launch's incarnation
are agreed through the job's own store (:func:`job_incarnation`), and
:func:`publish_together` is the one call every rank makes. Reading a sharded version, whole or by
region, is a format like any other (``weightstore.formats.sharded``).
"""

from weightstore import _lazy
from weightstore.sharded._agree import job_incarnation
from weightstore.sharded._cluster import Membership, is_tf_chief, membership, rank_in_tf_cluster, tf_config_task
from weightstore.sharded._shards import (
    Piece,
    clean_folder,
    commit_shards,
    next_attempt,
    publish_shard,
    publish_together,
)

__all__ = ["Piece", "publish_shard", "commit_shards", "publish_together", "next_attempt", "clean_folder",
           "job_incarnation",
           "Membership", "membership", "rank_in_tf_cluster", "is_tf_chief", "tf_config_task"]

#: each submodule imported on first use, as when ``import weightstore`` imported every layer
#: (``weightstore.io.objects.PART_BYTES``): :mod:`weightstore._lazy`
__getattr__, __dir__ = _lazy.on_first_use(globals(), {})
