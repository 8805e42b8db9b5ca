"""Hot reload's memory: which content digest each target last received, so assigning a newer
version skips, unread, the tensors that did not change."""

from __future__ import annotations

import weakref
from typing import Any

import weightstore
from weightstore.core.manifest import TensorInfo


class ChecksumMemory:
    """Which bytes each variable last received, so a newer version can skip unchanged tensors.

    Keyed weakly by an owner and a name in it (a TF1 session and a variable's name; a TF2
    variable or PyTorch tensor itself, with ""; a Flax module and a path), so forgetting a
    session or a model forgets its entries too. Owners are held by identity, not hash: TF2
    variables refuse ``hash()``, so a ``WeakKeyDictionary`` cannot hold them.
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, dict[str, str]]] = {}

    def _entries(self, owner: object) -> dict[str, str] | None:
        held = self._seen.get(id(owner))
        return held[1] if held is not None and held[0]() is owner else None

    def unchanged(self, owner: object, key: str, digest: str | None) -> bool:
        return digest is not None and self.recall(owner, key) == digest

    def recall(self, owner: object, key: str) -> str | None:
        """The digest ``owner``'s ``key`` last received, if known."""
        return (self._entries(owner) or {}).get(key)

    def remember(self, owner: object, key: str, digest: str | None) -> None:
        entries = self._entries(owner)
        if entries is None:
            entries = {}
            ident = id(owner)
            self._seen[ident] = (weakref.ref(owner, lambda _: self._seen.pop(ident, None)), entries)
        if digest is None:
            entries.pop(key, None)
        else:
            entries[key] = digest

    def forget(self, owner: object) -> None:
        if self._entries(owner) is not None:
            del self._seen[id(owner)]


MEMORY = ChecksumMemory()


def reload_digest(info: TensorInfo) -> str | None:
    """What hot reload compares to decide a tensor is unchanged: its content digest, dtype and
    shape (equal bytes of another dtype are other values). None where the file has no digest
    (written before manifest version 3): such a tensor is always written, never trusted to a
    CRC-32, which a changed tensor can match."""
    return None if info.digest is None else f"{info.digest} {info.dtype}{list(info.shape)}"


def wants_skip(weights: Any, skip_unchanged: bool | None) -> bool:
    """By default only versions (from ``publish``/``follow``) skip unchanged tensors.

    A plain path may be re-assigned on purpose to undo training, so it is always written.
    """
    if skip_unchanged is not None:
        return skip_unchanged
    return isinstance(weights, weightstore.sync.Version)
