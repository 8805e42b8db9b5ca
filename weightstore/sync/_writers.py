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


in_child(_forked)


def _key(folder: Folder) -> str:
    return os.path.realpath(folder.root) if isinstance(folder, LocalFolder) else folder.where


def published_here(folder: Folder, step: int) -> None:
    """Record that this process's publish of ``step`` moved ``folder``'s ``LATEST``."""
    _published[_key(folder)] = step


def taken_over(folder: Folder, latest_writer: object, latest_step: int | None) -> str | None:
    """Why this process may not publish to ``folder`` (another writer published there after it);
    ``None`` when it may: it never published there, ``LATEST`` is its own or a child's it forked
    (:func:`_forked`) or names no writer (written by hand, or by a weightstore before writers
    were recorded), or ``LATEST`` names a step no later than this process's last (a backup
    restored, of ``LATEST`` alone or of the whole folder: another writer's publish would have had
    to pass this process's step, as steps increase)."""
    mine = _published.get(_key(folder))
    if mine is None or not isinstance(latest_writer, str) or (latest_step is not None and latest_step <= mine):
        return None
    if latest_writer == _writer or latest_writer.startswith(f"{_writer} child "):  # its own, or a forked child's
        return None
    return (f"another writer ({latest_writer}) published step {latest_step} to this folder after this process "
            f"({_writer}) published step {mine}: two trainers publishing to one folder would have followers serve "
            "their models in turn, so the newer one keeps the folder and this process's publishes to it are refused "
            "(stop one of them, or give each a folder of its own; a process started anew, a notebook's restarted kernel "
            "too, takes the folder over with its first publish)")
