"""Files other tools wrote that need more than a suffix to recognise: TF checkpoints and ``.keras``
archives, which are read, and pickles (``torch.save``), which are refused.

:func:`open_foreign` is the one place :func:`weightstore.open` asks "is this a checkpoint or a
Keras archive?", so the API and the ``ws`` command accept the same paths. Keras
``.weights.h5`` files and plain ``np.savez``/h5py files need nothing here: the HDF5 and npz
readers read them as files without a manifest.

:func:`refuse_pickle` is asked, from a file's first bytes, when no format's magic matches them, or
when the reader the name or the magic picked refused the file (detection never overrides a
file's own valid structure: a safetensors header of 640 bytes starts with pickle's magic): a
``torch.save`` file (``.pt``, ``.pth``, Hugging Face's ``pytorch_model.bin``) is a zip whose
first member is ``<name>/data.pkl``, or, from PyTorch before 1.6, a bare pickle; unpickling
runs whatever code the file names, so weightstore never does, and says how to convert it. A zip
whose first member tells nothing (``torch.jit.save`` writes its tensors first) is refused by
:func:`refuse_torch_archive` from its member names, once the npz reader has read them.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection

from weightstore.errors import FormatError
from weightstore.formats import Reader, format_for_suffix

#: how many first bytes :func:`refuse_pickle` needs: a zip's first local header and its name
HEAD_BYTES = 512
_ZIP_LOCAL = b"PK\x03\x04"
_NAME_LENGTH = struct.Struct("<H")
#: a Hugging Face model folder's weights in one file, and the torch.save files it may hold instead
HF_SINGLE_FILE = "model.safetensors"
_TORCH_INDEX_SUFFIX = ".bin.index.json"
_TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_TF_NAMES = {"checkpoint", "saved_model.pb", "saved_model.pbtxt", "variables"}  # a TF checkpoint's or SavedModel's
_TORCH_ZIP = "a PyTorch torch.save file (a zip holding the pickle data.pkl)"
#: legacy ``torch.save``: protocol 2, then the pickled magic number 0x1950a86a20f9469cfc6c
_LEGACY_TORCH = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
_NEVER_UNPICKLED = ("weightstore never unpickles (unpickling runs code the file chooses) and did not unpickle this "
                    "one. Where you trust the file, convert it once with PyTorch: ")
CONVERT_HINT = (_NEVER_UNPICKLED + "ws.save('model.safetensors', torch.load(f, weights_only=True)) "
                "(of a training checkpoint, its state dict entry, such as ['model']; of a whole saved module, "
                "its .state_dict())")


def refuse_pickle(head: bytes) -> None:
    """Raise :class:`FormatError` if ``head`` (a file's first :data:`HEAD_BYTES`) starts a
    ``torch.save`` file or another pickle; nothing is unpickled to tell."""
    what = _pickle_kind(head)
    if what:
        raise FormatError(f"is {what}; {CONVERT_HINT}")


def refuse_torch_archive(members: Collection[str]) -> None:
    """Raise :class:`FormatError` if a zip's member names (from its central directory; no member
    is read) are a PyTorch archive's, whichever member comes first: a ``data.pkl``, and for
    ``torch.jit.save`` a ``constants.pkl`` beside it (its tensors come first, so the first bytes
    :func:`refuse_pickle` sees cannot tell)."""
    pickles = {name.rpartition("/")[2] for name in members if name.endswith(".pkl")}
    if "constants.pkl" in pickles:
        raise FormatError("is a PyTorch TorchScript archive (torch.jit.save: a zip holding the pickles data.pkl and "
                          f"constants.pkl); {_NEVER_UNPICKLED}ws.save('model.safetensors', "
                          "torch.jit.load(f).state_dict()) (torch.load refuses weights_only=True for TorchScript)")
    if "data.pkl" in pickles:
        raise FormatError(f"is {_TORCH_ZIP}; {CONVERT_HINT}")


def _pickle_kind(head: bytes) -> str:
    if head.startswith(_ZIP_LOCAL) and len(head) >= 30:
        (length,) = _NAME_LENGTH.unpack_from(head, 26)
        first = head[30:30 + length]
        if first == b"data.pkl" or first.endswith(b"/data.pkl"):
            return _TORCH_ZIP
        return ""
    if head.startswith(_LEGACY_TORCH):
        return "a PyTorch torch.save file in the legacy format (a bare pickle)"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"a Python pickle (protocol {head[1]})"
    return ""


def _holds_tf_checkpoint(folder: str) -> bool:
    """Whether ``folder`` holds a TF checkpoint or SavedModel: such a folder is left to their
    reader even where it also holds Hugging Face files, as before weightstore read those."""
    names = set(os.listdir(folder))
    return bool(names & _TF_NAMES) or any(name.endswith(".index") for name in names)


def _refuse_torch_weights(folder: str) -> None:
    """A folder whose weights are only ``torch.save`` pickles is refused naming the file."""
    for name in _TORCH_WEIGHTS:
        if os.path.isfile(os.path.join(folder, name)):
            raise FormatError(f"holds its weights as PyTorch torch.save pickles ({name}); {CONVERT_HINT}", path=folder)


def open_foreign(location: str, *, mmap: bool = True) -> Reader | None:
    """A reader for the Hugging Face folder (its ``model.safetensors``, else its sharded index:
    ``from_pretrained``'s order, so a folder holding both reads as transformers reads it)
    or sharded index, TF checkpoint (prefix, one of its files, or its folder) or ``.keras``
    archive at the local path ``location``; ``None`` when it is none of them.

    The reader's ``name`` is what it read (the checkpoint prefix a folder resolved to). A file
    whose suffix names a store format is answered without importing the checkpoint reader, so
    ``import weightstore`` and opening an npz never load protobuf.
    """
    if format_for_suffix(location) is not None and os.path.isfile(location):
        return None
    from weightstore.formats import hf_sharded

    hugging_face = os.path.isdir(location) and not _holds_tf_checkpoint(location)
    single = os.path.join(location, HF_SINGLE_FILE)
    if hugging_face and os.path.isfile(single):  # from_pretrained's order: this, the index, then pickles
        from weightstore.formats import safetensors

        return safetensors.FORMAT.open_reader(single, single, mmap=mmap)
    index = hf_sharded.index_location(location, is_dir=os.path.isdir, exists=os.path.isfile)
    if index is not None:
        return hf_sharded.open_local(index, mmap=mmap)
    if location.endswith(_TORCH_INDEX_SUFFIX):
        raise FormatError(f"is the index of PyTorch torch.save shards (pickles); {CONVERT_HINT}", path=location)
    if hugging_face:
        _refuse_torch_weights(location)
    from weightstore.formats.keras_file import KerasArchiveReader, is_keras_archive
    from weightstore.formats.tf_checkpoint import CheckpointReader, resolve_prefix

    prefix = resolve_prefix(location)
    if prefix is not None:
        return CheckpointReader(prefix)
    if is_keras_archive(location):
        return KerasArchiveReader(location)
    return None
