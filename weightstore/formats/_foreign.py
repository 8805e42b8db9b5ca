"""Files other tools wrote that weightstore refuses: pickles (``torch.save``).

TF checkpoints, ``.keras`` archives and Hugging Face model folders are formats of the one table
(:data:`weightstore.formats.FORMAT_MODULES`), recognised by where they lie; Keras
``.weights.h5`` files and plain ``np.savez``/h5py files are read by the HDF5 and npz readers as
files without a manifest.

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

import struct
from collections.abc import Collection

from weightstore.errors import FormatError

#: how many first bytes :func:`refuse_pickle` needs: a zip's first local header and its name
HEAD_BYTES = 512
_ZIP_LOCAL = b"PK\x03\x04"
_NAME_LENGTH = struct.Struct("<H")
#: a Hugging Face model folder's weights in one file
HF_SINGLE_FILE = "model.safetensors"
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
