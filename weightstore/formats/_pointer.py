"""``LATEST``: the small JSON file that names a versioned folder's current version.

Its format is here, below the layers that use it: the sync job writes and follows it
(:mod:`weightstore.sync`), and a reader given a versioned folder where a file was expected names
the version to read instead of saying "no TF checkpoint". Version files are named by step
(``step-000000000042.npz``): :data:`VERSION_NAME`.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from weightstore.core import _jsontext as jsontext
from weightstore.core.limits import MAX_POINTER_BYTES, POINTER_BYTES_PER_CONTAINER, VERSION_NAME_DIGITS
from weightstore.errors import FormatError

LATEST = "LATEST"
POINTER_FORMAT = "weightstore-latest"
#: a version's file name: ASCII digits only (``\d`` takes ``٣``), and few enough that ``int`` reads them
#: (it refuses over 4,300); a file system names none longer than 255 bytes anyway
VERSION_NAME = re.compile(rf"^step-([0-9]{{1,{VERSION_NAME_DIGITS}}})(\.[A-Za-z0-9]+)\Z")


def pointer_bytes(step: int, name: str, created: str, metadata: Mapping[str, Any], writer: str) -> bytes:
    """``LATEST``'s content naming version file ``name``, published by the process ``writer``
    (:mod:`weightstore.sync._writers`; older readers ignore the field)."""
    return json.dumps({"format": POINTER_FORMAT, "version": 1, "step": step, "file": name, "created": created,
                       "metadata": dict(metadata), "writer": writer}, sort_keys=True).encode()


def parse_pointer(data: bytes) -> dict[str, Any]:
    """``LATEST``'s fields, checked: a version file name whose step is the pointer's step.

    Raises :class:`FormatError` (naming no file: the caller names the folder) for anything else.
    """
    if len(data) > MAX_POINTER_BYTES:
        raise FormatError(f"LATEST is larger than {MAX_POINTER_BYTES} bytes, more than readers read; publish again "
                          "to repair it")
    if not data.strip():
        raise FormatError("LATEST is empty; publish again to repair it")
    try:
        pointer = jsontext.loads(data, what="LATEST", min_bytes=POINTER_BYTES_PER_CONTAINER)
    except FormatError:  # a name given twice too: no reading of it is the writer's
        pointer = None
    if not isinstance(pointer, dict):
        pointer = {}
    file_match = VERSION_NAME.match(pointer["file"]) if isinstance(pointer.get("file"), str) else None
    step = pointer.get("step")
    if (
        pointer.get("format") != POINTER_FORMAT or file_match is None
        or not isinstance(step, int) or isinstance(step, bool) or int(file_match.group(1)) != step
        or not isinstance(pointer.get("created", ""), str) or jsontext.too_deep(pointer.get("metadata"))
    ):
        raise FormatError("LATEST is not a weightstore version pointer; publish again to repair it")
    return pointer


def published_folder_message(folder: str, latest: str | None, held_by: str | None = None) -> str:
    """What a reader given the versioned folder ``folder`` (a path or URL) where a file was
    expected says: what it is, and which file to give (``latest``: the file ``LATEST`` names,
    ``None`` where it names none readable); the same words locally and on object storage.
    ``held_by``: what holds ``latest``'s name where it is no file (``"a symbolic link (to …)"``),
    which no reader of versions opens: said, rather than suggested."""
    where = f"{folder.rstrip('/')}/{latest}"
    if latest and held_by:
        return (f"is a folder of ws.publish versions, not one weight file; LATEST's {where} is {held_by}, which no "
                f"reader of versions opens: put the file itself in its place, or name another version (ws versions "
                f"{folder} lists them)")
    example = f"such as LATEST's {where}" if latest else "one of its step-* files"
    return f"is a folder of ws.publish versions, not one weight file; name a version, {example} {_listed_by(folder)}"


def _listed_by(folder: str) -> str:
    """Where a user finds a versioned folder's versions, said after each message naming one."""
    return f"(ws versions {folder} lists them; in Python: ws.load(ws.latest(folder)))"


def refuse_pointer(head: bytes, location: str) -> None:
    """Raise :class:`FormatError` if ``head``, the first bytes of the file at ``location`` given
    where a weight file was expected, are a ``LATEST``'s: a user who means a folder's newest
    version reaches for its ``LATEST`` first, and "not a weightstore file" told them nothing of
    the version it names. ``head`` may end before the pointer does (long metadata): then no
    version is named, only where to look."""
    if f'"format": "{POINTER_FORMAT}"'.encode() not in head:
        return
    folder = posixpath.dirname(location) or "."
    latest = latest_name(head)
    names = f"it names {folder}/{latest}, the version to read" if latest else "name one of its step-* files"
    raise FormatError(f"is a versioned folder's {LATEST} pointer, not a weight file; {names} {_listed_by(folder)}")


def latest_name(data: bytes) -> str | None:
    """The version file a ``LATEST``'s bytes name; ``None`` where they name none readable."""
    try:
        return str(parse_pointer(data)["file"])
    except FormatError:
        return None


def local_latest_name(folder: str) -> str | None:
    """The version file a local folder's ``LATEST`` names; ``None`` where it has no readable one."""
    try:
        with open(f"{folder}/{LATEST}", "rb") as file:
            return latest_name(file.read(MAX_POINTER_BYTES + 1))
    except OSError:
        return None
