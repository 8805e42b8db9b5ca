"""Hugging Face sharded safetensors: ``model-0000N-of-0000M.safetensors`` files and the
``model.safetensors.index.json`` that maps each tensor name to its shard.

Recognised by where it lies (:data:`FORMAT`'s ``find``): a model folder, local or remote, is
read as ``from_pretrained`` reads it (its ``model.safetensors``, else its sharded index), and
the index file itself names one. Read as one store, lazily: opening reads only the index; a shard's header is read the first
time one of its tensors (or its :meth:`~ShardedReader.info`) is asked for, so a selective
load opens only the shards holding what it selects. Each shard is checked against the index
when opened: it must hold exactly the tensors the index maps to it, no more and no fewer. A
shard name must be a plain file name beside the index (no folder, no ``..``), so a hostile
index cannot send reads elsewhere. Shards are safetensors files, read by the safetensors
reader over the same byte sources (mapped, owned, or ranged GETs for a URL); a shard
weightstore wrote carries its manifest, so its tensors are verified by checksum as usual, and
its index records the CRC-32 of its metadata and weight map (which no shard's checksum covers),
checked at open.

Writing (:func:`plan_shards`, :func:`index_document`) splits tensors in order into shards
of at most ``max_shard_size`` bytes (a larger tensor gets a shard of its own), as
``transformers``' ``save_pretrained`` does, and names them PyTorch's way by default, with
``__metadata__ {"format": "pt"}``, so ``transformers`` and ``safetensors`` load the folder.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from weightstore.core import _jsontext as jsontext
from weightstore.core.limits import HF_INDEX_BYTES_PER_CONTAINER, MAX_HF_INDEX_BYTES
from weightstore.core.manifest import TensorInfo, check_recorded, checksum
from weightstore.errors import (
    FileAccessError,
    FormatError,
    KeyNotInStoreError,
    StoreClosedError,
    TargetError,
    UnsafeFileError,
    named,
    naming,
)
from weightstore.formats import Format, Reader, ReaderDefaults, safetensors
from weightstore.formats._foreign import CONVERT_HINT, HF_SINGLE_FILE
from weightstore.io.places import Place
from weightstore.io.source import beside, byte_source, read_whole

INDEX_NAME = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"
FORMAT_NAME = "hf-sharded"
#: a key in the index that marks a folder weightstore wrote (``transformers`` ignores it)
PRODUCER_KEY = "weightstore"
#: the fields of that object: who wrote the folder, when, and the CRC-32 of what the index says
#: (:func:`_described`; folders written before it have none)
_PRODUCER_FIELDS = frozenset({"producer", "created", "checksum"})
_SHARD_NAME = re.compile(r"[^/\\\x00]+\.safetensors")
#: a shard named as ``save_pretrained`` names them: its number and the count of its shards
_NUMBERED = re.compile(r"(.*)-([0-9]{1,6})-of-([0-9]{1,6})(\.safetensors)")
#: the torch.save files a model folder may hold instead, and their sharded index's ending
_TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_TORCH_INDEX_SUFFIX = ".bin.index.json"
#: what marks a TF checkpoint's or SavedModel's folder
_TF_NAMES = {"checkpoint", "saved_model.pb", "saved_model.pbtxt", "variables"}


def find(place: Place) -> Place | None:
    """What a model folder at ``place`` is read from, in ``from_pretrained``'s order (so a folder
    holding both reads as transformers reads it): its ``model.safetensors``, else its index; an
    index file is itself. A folder holding a TF checkpoint or SavedModel is left to their reader
    even where it also holds a ``model.safetensors`` or pickles, as before weightstore read
    those (its sharded index is still read); one whose weights are only ``torch.save`` pickles
    is refused naming the file."""
    if place.text.endswith(_TORCH_INDEX_SUFFIX):
        raise FormatError(f"is the index of PyTorch torch.save shards (pickles); {CONVERT_HINT}", path=place.text)
    if place.text.endswith(INDEX_SUFFIX):
        return place
    if not place.is_dir():
        return None
    names = set(place.names())
    checkpoint = bool(names & _TF_NAMES) or any(name.endswith(".index") for name in names)
    weights = [name for name in ((INDEX_NAME,) if checkpoint else (HF_SINGLE_FILE, INDEX_NAME)) if name in names]
    for name in weights:
        if place.child(name).is_file():
            return place.child(name)
    for name in () if checkpoint else weights:  # a link loop, a dangling link, a FIFO: its reader says
        if not place.child(name).is_dir():  # which, naming the file, rather than "holds no TF checkpoint"
            return place.child(name)  # (a folder that holds one is read as one, as before)
    for name in () if checkpoint else _TORCH_WEIGHTS:
        if name in names:
            raise FormatError(f"holds its weights as PyTorch torch.save pickles ({name}); {CONVERT_HINT}",
                              path=place.text)
    return None


class ShardedReader(ReaderDefaults):
    """The index read at open; each shard's reader made when first needed, and checked against the index.

    ``open_shard(file name)`` returns a safetensors reader for a shard beside the index.
    """

    format = FORMAT_NAME

    def __init__(self, index_text: bytes, name: str, open_shard: Callable[[str], Any]):
        self.name = name
        self._open_shard = open_shard
        document = _parse_index(index_text, name)
        weight_map = document["weight_map"]
        self._shard_of: dict[str, str] = {}
        self._names_in: dict[str, set[str]] = {}
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str) or not _SHARD_NAME.fullmatch(shard) or shard.startswith(".."):
                raise UnsafeFileError(f"maps {tensor!r} to {_clip(shard)}, which is not a .safetensors file "
                                      "beside the index", path=name)
            self._shard_of[tensor] = shard
            self._names_in.setdefault(shard, set()).add(tensor)
        metadata = document.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise FormatError("index metadata is not an object", path=name)
        with naming(path=name):
            jsontext.refuse_deep(metadata, "index metadata")
        self.metadata: dict[str, Any] = {k: v for k, v in metadata.items() if k != "total_size"}
        producer = document.get(PRODUCER_KEY)
        self.has_checksums = isinstance(producer, dict)
        if isinstance(producer, dict):
            _check_index(document, producer, name)
        # an empty model's index: weightstore's carries the checksum, or (written before it) a total of 0 bytes
        written_empty = isinstance(producer, dict) and ("checksum" in producer or metadata.get("total_size") == 0)
        _check_complete(self._names_in, written_empty, name)
        self.created = str(producer.get("created", "")) if isinstance(producer, dict) else ""
        self._shards: dict[str, Any] = {}  # kept once closed: their headers still answer info()
        self._closed = False
        self._key_in_shard: dict[str, str] = {}

    def _shard(self, tensor: str) -> Any:
        shard = self._shard_of.get(tensor)
        if shard is None:
            raise KeyNotInStoreError("no such tensor", path=self.name, key=tensor)
        reader = self._shards.get(shard)
        if reader is None:
            if self._closed:  # a closed store opens no shard again
                raise StoreClosedError(f"store is closed; cannot read tensor {tensor!r}", path=self.name)
            reader = self._open_shard(shard)
            try:
                self._check_shard(shard, reader)
            except BaseException:
                reader.close()
                raise
            self._shards[shard] = reader
        return reader

    def _check_shard(self, shard: str, reader: Any) -> None:
        """The shard holds exactly what the index maps to it, named as the index names them, and
        was written by the save that wrote the index (both record its time): an overwrite that
        failed, or one under way, leaves new shards beside an old index, which never read as
        a mix of two models."""
        if self.created and reader.created and reader.created != self.created:
            raise FormatError(f"shard {shard!r} was written by another save ({reader.created}) than the index "
                              f"({self.created}): a save of the folder failed or is under way; save it again",
                              path=self.name)
        keys_by_name = reader.keys_by_name()
        held, listed = set(keys_by_name), self._names_in[shard]
        if held != listed:
            raise FormatError(f"shard {shard!r} does not hold what the index maps to it (in the index only: "
                              f"{named(sorted(listed - held))}; in the shard only: {named(sorted(held - listed))})",
                              path=self.name)
        self._key_in_shard.update({name: keys_by_name[name] for name in listed})

    # -- the Reader protocol --------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._shard_of)

    def info(self, key: str) -> TensorInfo:
        reader = self._shard(key)
        return reader.info(self._key_in_shard[key])._replace(key=key)

    def _reading(self, key: str) -> Any:
        """The reader of the shard holding ``key``, refusing as a plain reader does once closed."""
        if self._closed:
            raise StoreClosedError(f"store is closed; cannot read tensor {key!r}", path=self.name)
        return self._shard(key)

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        reader = self._reading(key)
        return reader.read(self._key_in_shard[key], verify=verify)

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        reader = self._reading(key)
        return reader.read_into(self._key_in_shard[key], out, verify=verify)

    def prefetch(self, keys: list[str]) -> None:
        """Each shard's selected tensors announced to it together (a remote shard fetches them at once)."""
        by_shard: dict[str, list[str]] = {}
        for key in keys:
            by_shard.setdefault(self._shard_of.get(key, ""), []).append(key)
        for wanted in by_shard.values():
            reader = self._reading(wanted[0])
            reader.prefetch([self._key_in_shard[key] for key in wanted])

    def close(self) -> None:
        self._closed = True
        for reader in self._shards.values():
            reader.close()


def open_reader(location: Any, name: str, *, mmap: bool = True) -> Reader:
    """The reader of what :func:`find` found: a model folder's ``model.safetensors`` (a
    safetensors file), or a sharded index whose shards lie beside it, read through the same
    byte sources (mapped or owned locally, ranged GETs for a URL)."""
    if not name.endswith(INDEX_SUFFIX):
        return safetensors.FORMAT.open_reader(location, name, mmap=mmap)
    text = read_whole(byte_source(location, name, mmap=mmap), MAX_HF_INDEX_BYTES, "sharded index")

    def open_shard(shard: str) -> Any:
        try:
            return safetensors.FORMAT.open_reader(*beside(location, name, shard), mmap=mmap)
        except FileNotFoundError:
            raise FormatError(f"the index maps tensors to shard {shard!r}, which is missing", path=name) from None
        except FileAccessError as exc:  # a name too long for the file system, a symlink loop
            raise FormatError(f"the index maps tensors to shard {_clip(shard)}, which {exc.message}",
                              path=name) from None

    return ShardedReader(text, name, open_shard)


def _no_writer(path: str, compress: bool | str) -> Any:
    raise TargetError("a Hugging Face sharded folder is written by ws.save(folder, weights, max_shard_size=...)",
                      path=path)


def _parse_index(text: bytes, name: str) -> dict[str, Any]:
    with naming(path=name):
        document = jsontext.loads(text, what="sharded index", min_bytes=HF_INDEX_BYTES_PER_CONTAINER)
    if not isinstance(document, dict) or not isinstance(document.get("weight_map"), dict):
        raise FormatError("sharded index has no weight_map object", path=name)
    return document


def _described(metadata: Any, weight_map: Any) -> bytes:
    """What a weightstore index's CRC-32 covers: its metadata and weight map, as JSON written one
    way. No shard's checksum covers the user metadata or which shards there are, so without it a
    changed byte of the metadata, or an entry gone from the map, read as written."""
    return json.dumps([metadata, weight_map], ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _check_index(document: dict[str, Any], producer: dict[str, Any], name: str) -> None:
    """A weightstore index's own checksum, where it records one; a damaged field name is one no writer makes."""
    unknown = sorted(set(producer) - _PRODUCER_FIELDS)
    if unknown:
        raise FormatError(f"index's {PRODUCER_KEY!r} object has fields {_clip(unknown)} no writer makes", path=name)
    if "checksum" in producer:  # a null is no checksum a writer makes, not an index without one
        check_recorded(_described(document.get("metadata"), document["weight_map"]), producer["checksum"], "index", name)


def _check_complete(names_in: Mapping[str, set[str]], written_empty: bool, name: str) -> None:
    """Refuse a weight map that cannot be whole, which would read as a model missing tensors, not a
    damaged index: one mapping no tensor (``save_pretrained`` never writes one), unless
    ``written_empty`` (weightstore's index of an empty model: its checksum says it was written so,
    and one written before the checksum records a ``total_size`` of 0, which a cut map keeps), or one whose
    shards are numbered ``-0000N-of-0000M`` and that maps nothing to some of those M. Real
    Hugging Face indexes carry no checksum, so this is all that tells a cut one."""
    if not names_in and not written_empty:
        raise FormatError("index maps no tensor to any shard (its weight_map is empty): a model's index maps "
                          "every tensor; this one is damaged or cut", path=name)
    matches = [_NUMBERED.fullmatch(shard) for shard in names_in]
    numbered = [match for match in matches if match is not None]
    if not numbered or len(numbered) < len(matches) or len({(m.group(1), int(m.group(3))) for m in numbered}) != 1:
        return  # named some other way: nothing counts the shards
    count, present = int(numbered[0].group(3)), {int(match.group(2)) for match in numbered}
    missing = list(itertools.islice((n for n in range(1, count + 1) if n not in present), 4))  # stops at the 4th
    if missing:
        raise FormatError(f"index maps no tensor to shard {named(missing)} of the {count} its shards' names count "
                          f"({numbered[0].group(1)}-N-of-{numbered[0].group(3)}.safetensors): its weight_map is cut",
                          path=name)


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


FORMAT = Format(name=FORMAT_NAME, suffixes=(INDEX_SUFFIX,), magic=lambda head: False, open_reader=open_reader,
                open_writer=_no_writer, compresses=False, writes=False, find=find)


# -- writing ---------------------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or ``"5GB"``, ``"500MB"``, ``"2GiB"`` as ``transformers`` takes it
    (and ``"100B"``, which the refusal's "a positive number of bytes" invites)."""
    if isinstance(size, int) and not isinstance(size, bool):
        count = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*((?:[KMGT]I?)?B)?\s*", size, re.IGNORECASE) if isinstance(size, str) else None
        count = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]) if match else 0
    if count <= 0:
        raise FormatError(f"max_shard_size={size!r}; give a positive number of bytes or a size such as '5GB'")
    return count


def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Keys in order, cut into shards of at most ``max_bytes`` (a larger tensor: a shard of its own)."""
    shards: list[list[str]] = [[]]
    held = 0
    for key, size in sizes.items():
        if shards[-1] and held + size > max_bytes:
            shards.append([])
            held = 0
        shards[-1].append(key)
        held += size
    return shards


#: the shards :func:`shard_names` names, and no other file (ASCII digits: a save removes stale ones)
OWN_SHARD = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")


def shard_names(count: int) -> list[str]:
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def save_time(index_text: bytes) -> str:
    """When the save that wrote this index wrote it (its shards record the same time), or ``""``
    for an index without one (``save_pretrained``'s, or one that does not parse): no reader can
    tell that index's shards from another save's."""
    try:
        producer = json.loads(index_text).get(PRODUCER_KEY)
    except (ValueError, AttributeError):
        return ""
    created = producer.get("created") if isinstance(producer, dict) else None
    return created if isinstance(created, str) else ""


def index_document(shards: Mapping[str, list[str]], total_size: int, metadata: Mapping[str, Any],
                   producer: Mapping[str, str]) -> bytes:
    """The index of ``shards`` (file name -> tensor names), as ``save_pretrained`` writes it."""
    weight_map = {name: shard for shard, names in shards.items() for name in names}
    described = {"total_size": total_size, **metadata}
    document = {"metadata": described, "weight_map": weight_map,
                PRODUCER_KEY: {**producer, "checksum": checksum(_described(described, weight_map))}}
    return json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8")
