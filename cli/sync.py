"""``ws versions`` and ``ws follow``: the sync verbs, for shell scripts and people.

``cli/main.py`` owns the app and calls :func:`register`; errors raised here are weightstore
errors, which its wrapper turns into one-line exit-1 messages.
"""

from __future__ import annotations

import json
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Add ``versions`` and ``follow`` to ``app``."""
    app.command("versions")(versions)
    app.command("follow")(follow)


def versions(
    folder: str = typer.Argument(..., help="Versioned folder: a local path or an fsspec URL (s3://, memory://)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per version, oldest first."),
) -> None:
    """List the versions in FOLDER: step, time, size, and which one LATEST names."""
    from weightstore.versions import list_versions

    entries = list_versions(folder)
    if as_json:
        for entry in entries:
            typer.echo(json.dumps({"step": entry.step, "path": entry.path, "modified": entry.modified,
                                   "size": entry.size, "latest": entry.latest}))
        return
    if not entries:
        typer.echo(f"{folder}: no versions")
        return
    for entry in entries:
        mark = "  <- LATEST" if entry.latest else ""
        typer.echo(f"{entry.step:>12}  {entry.modified}  {_human(entry.size):>9}  {entry.name}{mark}")


def follow(
    folder: str = typer.Argument(..., help="Versioned folder: a local path or an fsspec URL."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Stop after this many seconds without a new version."),
    after: Optional[int] = typer.Option(None, "--after", help="Only versions with a step above this one."),
    poll: float = typer.Option(1.0, "--poll", help="Seconds between looks at LATEST."),
    as_json: bool = typer.Option(False, "--json", help="Print each version as one JSON object."),
) -> None:
    """Print each new version of FOLDER as it lands (the latest one first), one per line."""
    from weightstore.versions import follow as follow_versions

    for version in follow_versions(folder, poll=poll, timeout=timeout, after=after):
        if as_json:
            typer.echo(json.dumps({"step": version.step, "path": version.path, "created": version.created,
                                   "metadata": version.metadata}))
        else:
            typer.echo(f"{version.step}\t{version.path}")


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"  # pragma: no cover
