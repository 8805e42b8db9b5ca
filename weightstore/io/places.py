"""Where a format that is recognised by where it lies looks: a local path or a URL, asked alike.

A file format is recognised by its suffix or its first bytes; a folder format (a Hugging Face
model folder) or a TF checkpoint prefix by what lies at a place: whether it is a folder, which
files it holds. :class:`Place` answers those few questions for a local path and for a URL in
the same words, so such a format's ``find`` (:class:`weightstore.formats.Format`) is written
once and reads local and remote folders alike; :meth:`Place.source` is then what its reader is
given, as any reader is (a local path, or a :class:`~weightstore.io.remote.RemoteFile`).
"""

from __future__ import annotations

import os
import posixpath
from typing import Any

from weightstore.errors import FileAccessError
from weightstore.io.location import Location, filesystem, location_of, service, uncached
from weightstore.io.remote import RemoteFile

__all__ = ["Place", "place_of"]


class Place:
    """A local path or a URL (``text``, as errors name it) and the questions asked of it."""

    def __init__(self, text: str, *, remote: bool, fs: Any = None, path: str = ""):
        self.text, self.remote = text, remote
        self._fs, self._path = fs, path  # a URL's file system and its path there

    def __repr__(self) -> str:
        return f"Place({self.text!r})"

    def child(self, name: str) -> Place:
        """The entry ``name`` directly in this folder."""
        if not self.remote:
            return Place(os.path.join(self.text, name), remote=False)
        return Place(f"{self.text.rstrip('/')}/{name}", remote=True, fs=self._fs, path=f"{self._path.rstrip('/')}/{name}")

    def is_dir(self) -> bool:
        if not self.remote:
            return os.path.isdir(self.text)
        with service(self.text):
            return bool(self._fs.isdir(self._path))

    def is_file(self) -> bool:
        if not self.remote:
            return os.path.isfile(self.text)
        with service(self.text):
            return bool(self._fs.isfile(uncached(self._fs, self._path)))

    def names(self) -> list[str]:
        """The names directly in this folder (none if it is not one)."""
        if not self.remote:
            try:
                return os.listdir(self.text)
            except (FileNotFoundError, NotADirectoryError):
                return []
            except OSError as exc:  # a folder the user may not list: the system's refusal, naming it
                raise FileAccessError(f"cannot be listed ({exc.strerror or exc})", path=self.text) from None
        with service(self.text):
            try:
                listed = self._fs.ls(uncached(self._fs, self._path), detail=False)
            except FileNotFoundError:
                return []
        return [posixpath.basename(str(name).rstrip("/")) for name in listed]

    def open_file(self) -> Any:
        """A URL's fsspec file object (h5py's reads: a format's ``remote_file_object``)."""
        return self._fs.open(uncached(self._fs, self._path), "rb")

    def source(self) -> str | RemoteFile:
        """What a format's ``open_reader`` is given for this file: its path, or its ranged reads."""
        return RemoteFile(self._fs, self._path, self.text) if self.remote else self.text


def place_of(path: Any) -> Place:
    """The place behind anything weightstore accepts as a file (see :func:`~weightstore.io.location.location_of`)."""
    where: Location = location_of(path)
    if not where.remote:
        return Place(where.text, remote=False)
    fs, remote = filesystem(where.text)
    return Place(where.text, remote=True, fs=fs, path=remote)
