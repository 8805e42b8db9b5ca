"""The arguments every publisher and follower takes, with their defaults and their checks.

One place for what a step, a count, ``keep``, a wait in seconds and ``LATEST``'s metadata must
be, so ``publish``, ``BackgroundPublisher``, the hooks, sharded commits and followers refuse the
same values with the same words, at the call rather than on a thread later.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from weightstore.core.limits import FILE_NAME_BYTES, MAX_POINTER_BYTES
from weightstore.core.manifest import utc_now
from weightstore.errors import (
    FormatError,
    SizeLimitError,
)
from weightstore.formats import Format, format_named
from weightstore.formats._pointer import pointer_bytes
from weightstore.io.files import TEMPORARY_EXTRA
from weightstore.store._save import checked_metadata
from weightstore.sync._writers import writer

#: a file name has at most :data:`FILE_NAME_BYTES`: ``step-``, the digits, at most 12 more (``.safetensors``,
#: ``.attempt-999``), and what the temporary it is written as adds
_MAX_STEP_DIGITS = FILE_NAME_BYTES - TEMPORARY_EXTRA - len("step-") - 12


def checked_count(name: str, value: Any) -> int:
    """``value`` as the non-negative int a step (rank, world, attempt) must be: of any integer
    type (numpy's ``int64``, what ``optimizer.iterations.numpy()`` gives), never a bool or a float."""
    number = _integer(value)
    if number is None or number < 0:
        raise ValueError(f"{name} must be a non-negative int, not {value!r}")
    return number


def checked_step(step: Any) -> int:
    """``step`` as :func:`checked_count` takes it, and short enough that its files' names fit
    the 255 bytes a file system allows (``step-…safetensors``, a sharded version's
    ``step-….attempt-N``): a longer one failed the write after the publish recorded its intent."""
    number = checked_count("step", step)
    if len(str(number)) > _MAX_STEP_DIGITS:
        raise ValueError(f"step must have at most {_MAX_STEP_DIGITS} digits, or its file names would be longer than "
                         f"the {FILE_NAME_BYTES} bytes a file system allows; step {str(number)[:20]}… is too large")
    return number


def checked_format(format: str) -> Format:  # noqa: A002
    """The format named ``format``, refused (:class:`FormatError`) unless a save writes it: a
    version is one npz, safetensors or HDF5 file. ``"tf-checkpoint"`` failed on an
    ``IndexError``, and ``"keras"`` said how ``ws import`` writes an archive."""
    fmt = format_named(format)
    if not fmt.writes:
        raise FormatError(f"a version is an npz, safetensors or hdf5 file; format {format!r} is read, never written "
                          "as one")
    return fmt


def checked_pointer_metadata(metadata: Mapping[str, Any] | None, step: int, name: str, where: str) -> dict[str, Any]:
    """``metadata`` as :func:`checked_metadata` takes it, refused as well
    (:class:`SizeLimitError`) when the ``LATEST`` that carries it would be larger than readers
    read: the version would be published and never reached. Checked before anything is written, with
    this moment standing in for the publish's ``created`` (always as long)."""
    metadata = checked_metadata(metadata, where)
    size = len(pointer_bytes(step, name, utc_now(), metadata, writer()))
    if size > MAX_POINTER_BYTES:
        raise SizeLimitError(f"metadata makes LATEST {size} bytes, over the {MAX_POINTER_BYTES} bytes readers read "
                             "(LATEST writes each non-ASCII character as 6 bytes); make the metadata smaller", path=where)
    return metadata


def checked_keep(keep: Any) -> int | None:
    """``keep`` (how many versions a publish leaves) as an int of at least 1, or ``None`` (all)."""
    if keep is None:
        return None
    number = _integer(keep)
    if number is None or number < 1:
        raise ValueError(f"keep must be an int of at least 1 (or None to keep all), not {keep!r}")
    return number


def checked_seconds(name: str, value: Any) -> float:
    """``value`` as a wait a thread can make: seconds, neither negative, NaN (which no comparison
    refuses: a loop on it would never end, or never pause) nor past ``threading.TIMEOUT_MAX``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) or not (
            0 <= value <= threading.TIMEOUT_MAX):
        raise ValueError(f"{name} must be seconds from 0 to {threading.TIMEOUT_MAX:.0f}, not {value!r}")
    return float(value)


def _integer(value: Any) -> int | None:
    """``value`` as an int where it is of an integer type (not a bool), else ``None``."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(type(value), "__index__"):
        return None
    return operator.index(value)
