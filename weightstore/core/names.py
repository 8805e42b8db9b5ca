"""How each framework names tensors in its files, and how a key is formed from those names.

A key is ``/``-separated (``features/0/weight``). TensorFlow and Keras name variables the
same way, so their names are keys as they are. PyTorch's ``state_dict`` (and so
``safetensors.torch.save_file`` and every Hugging Face ``model.safetensors``) joins module
and parameter names with ``.`` (``features.0.weight``); PyTorch refuses ``.`` inside a
module's or a tensor's own name, so ``.`` <-> ``/`` is exact both ways, with one exception
this module refuses rather than guesses: a torch name holding ``/`` (``register_buffer("a/b")``
is legal) has no key that reads back as it.

``names="torch"`` (:data:`TORCH`) is the one word for "tensor names are PyTorch's" wherever
names cross a boundary: ``torch.export(..., names="torch")`` returns ``state_dict`` names,
``ws.save(..., names="torch")`` and ``ws convert --names torch`` write them into the file,
``ws.open(..., names="torch")`` reads a file's names as them. ``names="file"``
(:data:`FILE`) keeps a foreign file's names as they are written.

A file written so remembers it: safetensors records each key beside its name; npz and HDF5,
whose tensors have no second name, carry :data:`NAMES_METADATA` in the manifest's metadata, and
are read by their keys again. ``ws.save`` of a ``state_dict`` itself (torch tensors under torch
names, :func:`is_state_dict`) writes its names so without being asked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from weightstore.core.keys import validate_key, validate_keys
from weightstore.errors import InvalidKeyError

TORCH = "torch"
FILE = "file"
KEYS = "keys"
#: what ``names=`` accepts on reading (``None``: what the file says, see :func:`reads_as_torch`)
READ_NAMINGS = (TORCH, FILE)
#: what ``names=`` accepts on writing (``None`` or ``"keys"``: keys as they are)
WRITE_NAMINGS = (TORCH, KEYS)
#: the manifest metadata entry of an npz or HDF5 file whose tensor names are PyTorch's (value
#: :data:`TORCH`): those formats hold no key beside a name, so this tells readers to read them as keys
NAMES_METADATA = "weightstore-names"
#: the formats whose foreign files PyTorch and Hugging Face write, read by their names when those are torch names
TORCH_FORMATS = frozenset({"safetensors", "hf-sharded"})


def check_naming(names: str | None, accepted: tuple[str, ...]) -> str | None:
    if names is not None and names not in accepted:
        choices = ", ".join(repr(n) for n in accepted)
        raise ValueError(f"names={names!r}; use {choices} or None")
    return names


def key_of_torch_name(name: str) -> str:
    """``features.0.weight`` -> ``features/0/weight``; :class:`InvalidKeyError` if no key reads back as ``name``."""
    if "/" in name:
        raise InvalidKeyError(f"torch name {name!r} holds '/', which keys use where torch names use '.': "
                              "no key reads back as it; rename the parameter or buffer")
    try:
        return validate_key(name.replace(".", "/"))
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"torch name {name!r} is no key ({exc})") from None


def keys_of_torch_names(names: list[str]) -> list[str]:
    """:func:`key_of_torch_name` of each name, in order, refusing as it refuses the first name
    that makes no key. Names with no ``/`` (a ``state_dict``'s) are turned and checked all at
    once (:func:`~weightstore.core.keys.validate_keys`), not one call per name: a file of 100
    tensors spent a tenth of its open here."""
    joined = "\0".join(names)
    keys = joined.replace(".", "/").split("\0") if "/" not in joined else []
    if len(keys) == len(names):  # no name held NUL, which would split it (and no key holds)
        try:
            return validate_keys(keys)
        except InvalidKeyError:
            pass  # named by the rule, one name at a time
    return list(map(key_of_torch_name, names))


def torch_name_of_key(key: str) -> str:
    """``features/0/weight`` -> ``features.0.weight``; :class:`InvalidKeyError` for a key whose
    segments hold ``.`` (``dense.1/kernel`` would read back as ``dense/1/kernel``)."""
    validate_key(key)
    if "." in key:
        raise InvalidKeyError("has a '.' inside a segment; torch names join segments with '.', so it would "
                              "read back as another key; save without names='torch', or rename it", key=key)
    return key.replace("/", ".")


def torch_keys(names: Iterable[str]) -> dict[str, str]:
    """Key -> name for values named either way: each torch name (``.``, no ``/``) read as its
    key; a name that makes no key, or the same key as another name, stays as it is."""
    names = list(names)
    renamed = {name: _as_key(name) for name in names}
    counts = Counter(renamed.values())
    return {key if counts[key] == 1 else name: name for name, key in renamed.items()}


def _as_key(name: str) -> str:
    if "." not in name or "/" in name:
        return name
    try:
        return key_of_torch_name(name)
    except InvalidKeyError:
        return name


def reads_as_torch(names: Iterable[str]) -> bool:
    """Whether a foreign file's tensor names are PyTorch's: some hold ``.`` and none holds ``/``."""
    joined = "\0".join(names)  # one search of them all, not a step per name
    return "/" not in joined and "." in joined


def is_state_dict(weights: object) -> bool:
    """Whether ``weights`` is a PyTorch ``state_dict`` (or ``named_parameters``) as PyTorch gives
    it: torch tensors under names that read as torch's (:func:`reads_as_torch`). Such names are
    no keys (``ws.load(f, scope="features")`` would find nothing under ``features.0.weight``):
    ``ws.save`` writes them as ``names="torch"`` does. Asked without importing torch, and of
    the values the dict holds (``dict.values``), never of a subclass's ``__getitem__``: a lazy
    mapping's tensors are not fetched to be asked, nor any before the save's own checks. Names
    PyTorch never gives (``a..b``, ``a.``: an empty module name) make a dict of the caller's own
    keys, saved as written, as before state_dicts were told apart (it was refused: no key)."""
    if not isinstance(weights, dict) or not weights or not all(isinstance(name, str) for name in weights):
        return False
    if not (reads_as_torch(weights) and all(type(value).__module__.partition(".")[0] == "torch"
                                            for value in dict.values(weights))):
        return False
    try:
        keys_of_torch_names(list(weights))
    except InvalidKeyError:
        return False
    return True
