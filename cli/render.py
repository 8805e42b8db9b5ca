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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import typer
from rich import progress as rich_progress
from rich.console import Console
from rich.table import Table

from weightstore.manifest import TensorInfo

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


def stdout() -> Console:
    return Console(highlight=False, markup=False)


def stderr() -> Console:
    return Console(stderr=True, highlight=False, markup=False)


def note(message: str) -> None:
    """A status line on stderr, silenced by ``--quiet``."""
    if not settings.quiet:
        typer.echo(message, err=True)


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


def track(items: Iterable[tuple[T, int]], description: str, total_bytes: int) -> Iterator[T]:
    """Yield each item, advancing a byte-counting progress bar on stderr when it is worth one."""
    console = stderr()
    enabled = not settings.quiet and console.is_terminal
    started = time.monotonic()
    done = 0
    bar = None
    try:
        for item, nbytes in items:
            yield item
            done += nbytes
            if bar is None and enabled and time.monotonic() - started > PROGRESS_DELAY_S:
                bar = rich_progress.Progress(
                    rich_progress.TextColumn("{task.description}"),
                    rich_progress.BarColumn(),
                    rich_progress.DownloadColumn(binary_units=True),
                    rich_progress.TransferSpeedColumn(),
                    rich_progress.TimeRemainingColumn(),
                    console=console,
                    transient=True,
                )
                task = bar.add_task(description, total=total_bytes, completed=done)
                bar.start()
            elif bar is not None:
                bar.update(task, completed=done)
    finally:
        if bar is not None:
            bar.stop()


@contextlib.contextmanager
def working(description: str) -> Iterator[None]:
    """A spinner on stderr for a step with no measurable progress (a file being written),
    shown only on a terminal, without ``--quiet``, once the step has run for a moment."""
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


def listing_table(infos: list[TensorInfo], title: str) -> Table:
    table = Table(title=title, title_justify="left", show_footer=True, expand=False)
    total = sum(info.nbytes for info in infos)
    table.add_column("key", footer=count(len(infos), "tensor"), overflow="fold", ratio=1)
    table.add_column("dtype", no_wrap=True)
    table.add_column("shape", no_wrap=True, overflow="fold")
    table.add_column("size", footer=human_bytes(total), justify="right", no_wrap=True)
    for info in infos:
        table.add_row(info.key, info.dtype, str(info.shape), human_bytes(info.nbytes))
    return table


def print_json(document: Any) -> None:
    typer.echo(json.dumps(document, indent=2, ensure_ascii=False))


def emit(command: str, document: dict[str, Any]) -> None:
    """A command's result with ``--json``: one object, ``{"command": …, "ok": true, …}``.

    Every command prints exactly one such object on stdout (``ws follow`` one per version, on
    one line each, since it streams); a failure prints ``{"command": …, "ok": false, "error":
    {"type", "message", "path", "key"}}`` instead, as :func:`error_document` builds it.
    """
    print_json({"command": command, "ok": True, **document})


def error_document(command: str | None, exc: BaseException, message: str) -> dict[str, Any]:
    return {"command": command, "ok": False, "error": {
        "type": type(exc).__name__, "message": message,
        "path": getattr(exc, "path", None) if isinstance(getattr(exc, "path", None), str) else None,
        "key": getattr(exc, "key", None) if isinstance(getattr(exc, "key", None), str) else None,
    }}
