"""Who publishes to a folder: this process's name in ``LATEST``, and the folders it published to.

Steps that go back are refused (:meth:`FolderState.check_step`), but two live trainers whose
steps both go up (two runs started into one folder, or a restarted run while the old one still
lives) would each pass that check in turn, and followers would serve their models one after the
other. So every publish writes its process's name into ``LATEST`` (``"writer"``), and a
process that has published to a folder refuses to publish there again once ``LATEST`` names
another writer: the newer writer took the folder over. A process's first publish to a folder
takes it over whoever wrote before, so a restarted trainer goes on at once, and nothing is
left behind that a crashed trainer would hold: the check costs no request (``LATEST`` is read
by every publish anyway) and no lock. A forked child is a writer of its own whose publishes
do not take the folder from its parent (:func:`_forked`).

"Before" is before the process first began to write there (:func:`tried_here`: a publish that
passed its checks), not before its first publish that went through: a trainer stopped in its
first publish (SIGSTOP, a paused node), or whose first publish failed on its storage, while its
restart on another node took the folder over, would otherwise take it back with its next
publish and lock the restart out. A publish refused before it writes (a step not above
``LATEST``'s: a trainer restarted from an older checkpoint) is no such beginning, so of two
trainers restarted that way, the later to publish takes the folder over, as before.
"""

from __future__ import annotations

import os
import secrets
import socket

from weightstore.core._forks import in_child
from weightstore.formats._pointer import parse_pointer
from weightstore.io.folders import Folder, LocalFolder


def _name() -> str:
    """This process's writer name: its host and PID, and a token that a PID reused never repeats."""
    return f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(4)}"


#: this process's writer name, as ``LATEST`` records it
_writer = _name()
#: the folders this process has published to, by :func:`_key`: the step it published last
_published: dict[str, int] = {}
#: the folders this process tried to publish to before it published there, by :func:`_key`: the
#: writer and step ``LATEST`` named at its first try
_tried: dict[str, tuple[object, int | None]] = {}


def writer() -> str:
    """This process's writer name (a forked child's changes at the fork), read at each publish."""
    return _writer


def written_here(pointer: bytes) -> bool:
    """Whether ``LATEST``'s bytes ``pointer`` name this process as their writer."""
    return parse_pointer(pointer).get("writer") == _writer


def _forked() -> None:
    """A forked child is a writer of its own, as two trainers forked from one launcher are; its
    name begins with its parent's, whose publishes go on after the child's (a trainer writing
    each snapshot from a child that shares its pages, then its final weights itself), while the
    child's after the parent's are refused."""
    global _writer
    _writer = f"{_writer} child {_name()}"
    _published.clear()
    _tried.clear()


in_child(_forked)


def _key(folder: Folder) -> str:
    return os.path.realpath(folder.root) if isinstance(folder, LocalFolder) else folder.where


def published_here(folder: Folder, step: int) -> None:
    """Record that this process's publish of ``step`` moved ``folder``'s ``LATEST``."""
    _published[_key(folder)] = step


def tried_here(folder: Folder, latest_writer: object, latest_step: int | None) -> None:
    """Record, at this process's first publish to ``folder`` that passed its checks (it goes on
    to write), the writer and step of ``LATEST`` it found: a writer that takes the folder over
    after this keeps it, even where this publish then failed."""
    _tried.setdefault(_key(folder), (latest_writer, latest_step))


def taken_over(folder: Folder, latest_writer: object, latest_step: int | None) -> str | None:
    """Why this process may not publish to ``folder`` (another writer published there after it,
    or, where it never published there, after its first try: :func:`tried_here`);
    ``None`` when it may: it never tried to publish there, ``LATEST`` is its own or a child's it forked
    (:func:`_forked`) or names no writer (written by hand, or by a weightstore before writers
    were recorded), or ``LATEST`` names a step no later than this process's last (a backup
    restored, of ``LATEST`` alone or of the whole folder: another writer's publish would have had
    to pass this process's step, as steps increase)."""
    key = _key(folder)
    mine = _published.get(key)
    if mine is None and key in _tried:  # it never published here: a writer new since it began to took over
        found, found_step = _tried[key]
        if latest_writer == found or latest_step is None or (found_step is not None and latest_step <= found_step):
            return None
        after = "began its first publish here (" + (
            "before LATEST existed)" if found_step is None else f"when LATEST named step {found_step})")
    elif mine is None or latest_step is not None and latest_step <= mine:
        return None
    else:
        after = f"published step {mine}"
    if not isinstance(latest_writer, str) or latest_writer == _writer or latest_writer.startswith(f"{_writer} child "):
        return None  # no writer recorded, its own, or a forked child's
    return (f"another writer ({latest_writer}) published step {latest_step} to this folder after this process "
            f"({_writer}) {after}: two trainers publishing to one folder would have followers serve "
            "their models in turn, so the newer one keeps the folder and this process's publishes to it are refused "
            "(stop one of them, or give each a folder of its own; a process started anew, a notebook's restarted kernel "
            "too, takes the folder over with its first publish)")
