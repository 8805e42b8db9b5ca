"""Files other tools wrote that need more than a suffix to recognise: TF checkpoints and ``.keras`` archives.

:func:`open_foreign` is the one place :func:`weightstore.open` asks "is this a checkpoint or a
Keras archive?", so the API and the ``ws`` command accept the same paths. Keras
``.weights.h5`` files and plain ``np.savez``/h5py files need nothing here: the HDF5 and npz
readers read them as files without a manifest.
"""

from __future__ import annotations

import os

from weightstore.formats import Reader, format_for_suffix


def open_foreign(location: str) -> Reader | None:
    """A reader for the TF checkpoint (prefix, one of its files, or its folder) or ``.keras``
    archive at the local path ``location``; ``None`` when it is neither.

    The reader's ``name`` is what it read (the checkpoint prefix a folder resolved to). A file
    whose suffix names a store format is answered without importing the checkpoint reader, so
    ``import weightstore`` and opening an npz never load protobuf.
    """
    if format_for_suffix(location) is not None and os.path.isfile(location):
        return None
    from weightstore.formats.keras_file import KerasArchiveReader, is_keras_archive
    from weightstore.formats.tf_checkpoint import CheckpointReader, resolve_prefix

    prefix = resolve_prefix(location)
    if prefix is not None:
        return CheckpointReader(prefix)
    if is_keras_archive(location):
        return KerasArchiveReader(location)
    return None
