"""What the `ws` command shows: tables on stdout, progress and notes on stderr.

Data goes to stdout, everything else to stderr, so ``ws ls --json m.npz | jq`` and
``ws export … 2>/dev/null`` both work. Progress bars appear only on a terminal, only
without ``--quiet``, and only once an operation has run for a moment, so short commands
never flash one.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich import progress as rich_progress
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from weightstore.core.keys import misprints
from weightstore.errors import ChecksumError

if TYPE_CHECKING:  # numpy and the manifest only annotate here: ``ws --help`` imports neither
    import numpy as np

    from weightstore.core.manifest import TensorInfo

T = TypeVar("T")
PROGRESS_DELAY_S = 0.5


@dataclass
class Settings:
    """The global options; set by the app's callback at the start of every invocation."""

    quiet: bool = False
    debug: bool = False
    json: bool = False

    def reset(self) -> None:
        self.quiet = self.debug = self.json = False


settings = Settings()
_PIPED_WIDTH = 1 << 12  # columns for output that is not a terminal: only a key longer than this folds


def stdout() -> Console:
    """Standard output; piped or redirected, as wide as its lines need, so no key is folded
    across lines where ``grep`` or a copy would miss it (a terminal folds at its own width)."""
    console = Console(highlight=False, markup=False)
    if not console.is_terminal:
        console.width = _PIPED_WIDTH
    return console


def stderr() -> Console:
    return Console(stderr=True, highlight=False, markup=False)


def note(message: str) -> None:
    """A status line on stderr, silenced by ``--quiet``; a file's name in it shown as ``ws ls``
    shows it (:func:`printable`)."""
    if not settings.quiet:
        typer.echo(printable(message), err=True)


def count(number: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def human_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    exponent = min(int(math.log(size, 1024)), 4)
    return f"{size / 1024 ** exponent:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


def tensor_type(info: TensorInfo) -> str:
    """``float32[3, 4]``: a tensor's dtype and shape in one word."""
    return f"{info.dtype}[{', '.join(map(str, info.shape))}]"


class ByteBar:
    """The progress bar of every long operation: bytes done of the total, speed, time left.

    On stderr, only on a terminal, only without ``--quiet``, and only once the operation has
    run for :data:`PROGRESS_DELAY_S`; it disappears when done.
    """

    def __init__(self, description: str, total_bytes: int):
        self._console = stderr()
        self._enabled = not settings.quiet and self._console.is_terminal
        self._description = description
        self._total = total_bytes
        self._started = time.monotonic()
        self._done = 0
        self._bar: rich_progress.Progress | None = None
        self._task: Any = None

    def advance(self, nbytes: int) -> None:
        self._done += nbytes
        if self._bar is not None:
            self._bar.update(self._task, completed=self._done)
        elif self._enabled and time.monotonic() - self._started > PROGRESS_DELAY_S:
            self._bar = rich_progress.Progress(
                rich_progress.TextColumn("{task.description}"),
                rich_progress.BarColumn(),
                rich_progress.DownloadColumn(binary_units=True),
                rich_progress.TransferSpeedColumn(),
                rich_progress.TimeRemainingColumn(),
                console=self._console,
                transient=True,
            )
            self._task = self._bar.add_task(self._description, total=self._total, completed=self._done)
            self._bar.start()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def track(items: Iterable[tuple[T, int]], description: str, total_bytes: int) -> Iterator[T]:
    """Yield each item, advancing a :class:`ByteBar` by its bytes once it has been handled."""
    bar = ByteBar(description, total_bytes)
    try:
        for item, nbytes in items:
            yield item
            bar.advance(nbytes)
    finally:
        bar.close()


@contextlib.contextmanager
def counted(weights: Mapping[str, np.ndarray], description: str) -> Iterator[dict[str, Any]]:
    """``weights`` for :func:`weightstore.save` to write under a :class:`ByteBar`.

    ``save`` checks each value's ``dtype`` first and converts it (``np.asarray``) only when it
    writes it, one tensor at a time, so each value advances the bar as it goes to the file:
    compressing, HDF5 and the pages of a mapped source are where a write spends its time.
    """
    bar = ByteBar(description, sum(array.nbytes for array in weights.values()))
    try:
        yield {key: _Counted(array, bar) for key, array in weights.items()}
    finally:
        bar.close()


class _Counted:
    """An array that advances a bar when it is converted for writing."""

    def __init__(self, array: np.ndarray, bar: ByteBar):
        self.dtype, self.shape = array.dtype, array.shape  # what save plans by, without converting
        self._array = array
        self._bar = bar

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self._bar.advance(self._array.nbytes)
        return self._array if dtype is None else self._array.astype(dtype, copy=False)


@contextlib.contextmanager
def working(description: str) -> Iterator[None]:
    """A spinner on stderr for a step with no measurable progress (TensorFlow writing a
    checkpoint in one call), shown only on a terminal, without ``--quiet``, once the step has
    run for a moment."""
    console = stderr()
    if settings.quiet or not console.is_terminal:
        yield
        return
    status = console.status(description)
    timer = threading.Timer(PROGRESS_DELAY_S, status.start)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        status.stop()


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on or misprint escaped (``\\x1b``,
    :func:`~weightstore.core.keys.misprints`): keys can hold none of them, but a file's metadata and
    a path can, and ``ws ls`` must show them, not run them."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(char.encode("unicode_escape").decode("ascii") if misprints(char) else char for char in text)


#: ``ws ls`` lists more tensors than this as plain aligned columns (:func:`listing_lines`) instead
#: of a table: rich lays a table out cell by cell, about 0.25 ms a row (2.5 s for 10,000 tensors,
#: four times the rest of the command), and a listing that long scrolls past as lines anyway
TABLE_ROWS = 500


def listing_table(infos: list[TensorInfo]) -> Table:
    table = Table(show_footer=True, expand=False)
    total = sum(info.nbytes for info in infos)
    table.add_column("key", footer=count(len(infos), "tensor"), overflow="fold", ratio=1)
    table.add_column("dtype", no_wrap=True)
    table.add_column("shape", no_wrap=True, overflow="fold")
    table.add_column("size", footer=human_bytes(total), justify="right", no_wrap=True)
    for info in infos:
        table.add_row(info.key, info.dtype, str(info.shape), human_bytes(info.nbytes))
    return table


def listing_lines(infos: list[TensorInfo]) -> Iterator[str]:
    """The columns of :func:`listing_table` as plain text, each padded to its widest cell (keys by
    the terminal cells they take), sizes right-aligned: a header, a line a tensor, the totals.
    Never folded, so each key stays whole on its line for ``grep``."""
    rows = [("key", "dtype", "shape", "size"),
            *((info.key, info.dtype, str(info.shape), human_bytes(info.nbytes)) for info in infos),
            (count(len(infos), "tensor"), "", "", human_bytes(sum(info.nbytes for info in infos)))]
    key_cells = [cell_len(row[0]) for row in rows]
    widths = [max(key_cells), *(max(len(row[column]) for row in rows) for column in (1, 2, 3))]
    for (key, dtype, shape, size), cells in zip(rows, key_cells, strict=True):
        yield f"{key}{' ' * (widths[0] - cells)}  {dtype:<{widths[1]}}  {shape:<{widths[2]}}  {size:>{widths[3]}}"


def print_json(document: Any) -> None:
    typer.echo(json.dumps(document, indent=2, ensure_ascii=False))


def emit(command: str, document: dict[str, Any]) -> None:
    """A command's result with ``--json``: one object, ``{"command": …, "ok": true, …}``.

    Every command prints exactly one such object on stdout (``ws follow`` one per version, on
    one line each, since it streams); a failure prints ``{"command": …, "ok": false, "error":
    {"type", "message", "path", "key", "keys"}}`` instead, as :func:`error_document` builds it.
    """
    print_json({"command": command, "ok": True, **document})


def error_document(command: str | None, exc: BaseException, message: str) -> dict[str, Any]:
    """The ``--json`` failure: ``key`` names the tensor when exactly one is at fault, ``keys``
    every tensor at fault (all the corrupt ones ``ws verify`` found), so scripts need not parse
    the message."""
    key = getattr(exc, "key", None) if isinstance(getattr(exc, "key", None), str) else None
    several = exc.keys if isinstance(exc, ChecksumError) else []
    return {"command": command, "ok": False, "error": {
        "type": type(exc).__name__, "message": message,
        "path": getattr(exc, "path", None) if isinstance(getattr(exc, "path", None), str) else None,
        "key": key, "keys": several or ([key] if key is not None else []),
    }}
