"""Where a rank's part of a PyTorch tensor lies in the whole: DTensor shards and plain tensors.

A ``DTensor`` (what ``torch.distributed.tensor.distribute_tensor``, tensor-parallel plans and
FSDP2's ``fully_shard`` make of parameters) holds on each rank one box of its global tensor;
:func:`local_region` says which, as PyTorch's own checkpointing computes it (the local shape
and global offset of its placements on its mesh). Publishing writes each box once: of ranks
holding the same box (a placement ``Replicate`` on some mesh axis), only the one at coordinate
0 of those axes writes it (:func:`writes_local`). A DTensor on a submesh (FSDP2 over
``mesh["dp"]`` of a (dp, tp) mesh, on a layer tensor parallelism leaves alone) cannot tell its
copies along the root mesh's other axes from pipeline stages holding other layers, so each copy
writes its shard, and the commit keeps one of a part written alike (refusing copies that
differ). A plain tensor that every rank holds whole
is split by rows between the ranks (:func:`weightstore.sharded._shards.split_rows`), so each writes a share and none
sends a byte to another. Assigning reads for a DTensor only its local box.
"""

from __future__ import annotations

from typing import Any

from weightstore.core._extras import needs
from weightstore.errors import TargetError

with needs("torch", __name__):
    import torch

__all__ = ["is_sharded", "local_region", "local_tensor", "writes_local"]

Region = tuple[slice, ...]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return None
    return DTensor


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (its data spread over a device mesh)."""
    kind = _dtensor_type()
    return kind is not None and isinstance(tensor, kind)


def local_region(tensor: Any, key: str) -> Region | None:
    """The box of the global tensor this rank's local shard of ``tensor`` (at ``key``) holds
    (None: a plain tensor).

    Raises:
        TargetError: a ``Partial`` placement: the local tensor is a summand, not a part of the value.
    """
    if not is_sharded(tensor):
        return None
    if any(placement.is_partial() for placement in tensor.placements):
        raise TargetError(f"is a DTensor with placements {tensor.placements}: it holds partial sums, not a part of "
                          "its value; redistribute it to Shard or Replicate placements first", key=key)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def local_tensor(tensor: Any) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard (written in place, it is the
    DTensor's data), or the tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def writes_local(tensor: Any) -> bool:
    """Whether this rank writes its shard of a DTensor: among the ranks holding the same box
    (those differing only along mesh axes where it is replicated), the one at coordinate 0;
    and only a shard that holds elements, unless the whole tensor is empty."""
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None or (tensor.numel() and not tensor.to_local().numel()):  # not on the mesh, or no rows left
        return False
    return all(at == 0 for at, placement in zip(coordinate, tensor.placements, strict=True)
               if placement.is_replicate())
