"""``ws versions``, ``ws follow`` and ``ws clean``: the sync verbs, for shell scripts and people.

``cli/main.py`` owns the app and calls :func:`register`; errors raised here are weightstore
errors, which its wrapper turns into one-line exit-1 messages.
"""

from __future__ import annotations

import functools
import json
import threading
import warnings
from typing import Annotated

import typer

from weightstore.cli.render import emit, human_bytes, note, printable, settings
from weightstore.errors import StorageError
from weightstore.sync._defaults import DEFAULT_POLL


def register(app: typer.Typer) -> None:
    """Add ``versions``, ``follow`` and ``clean`` to ``app``."""
    app.command("versions")(versions)
    app.command("follow")(follow)
    app.command("clean")(clean)


Folder = Annotated[str, typer.Argument(help="Versioned folder: a local path or an fsspec URL (s3://, memory://).")]


def versions(
    folder: Folder,
    as_json: Annotated[bool, typer.Option("--json", help="Print the versions as one JSON object, oldest first.")
                       ] = False,
) -> None:
    """List the versions in FOLDER: step, time, size, full or delta (and its base), and which one LATEST names.

    A delta whose base file is not in FOLDER is marked "missing": it and the deltas after it
    cannot be read until the next full version.

    A version name held by no file (a folder, a FIFO, a symbolic link) is listed as "not a
    file": no reader opens it.

    A damaged LATEST marks none: what is wrong with it goes to stderr (and, with --json, in
    "latest_error"), and the versions are listed all the same.

    \b
    Example:
      ws versions s3://bucket/run --json
    """
    from weightstore.sync._listing import version_listing

    settings.json = settings.json or as_json  # so a failure is reported as JSON too
    entries, damage = version_listing(folder)
    if damage is not None:
        typer.echo(f"warning: {damage}", err=True)
    # a delta whose base is gone (removed by hand, or never copied with it) reads as no version at
    # all: said here, where one looks first, rather than only when a reader fails on it
    listed = {entry.name for entry in entries}
    if settings.json:
        emit("versions", {"folder": folder, "versions": [
            {"step": entry.step, "path": entry.path, "modified": entry.modified, "size": entry.size,
             "latest": entry.latest, "members": entry.members, "member_bytes": entry.member_bytes,
             "kind": entry.kind, "base": entry.base,
             "base_missing": entry.base is not None and entry.base not in listed, "not_file": entry.not_file}
            for entry in entries], "latest_error": None if damage is None else str(damage)})
        return
    if not entries:
        _refuse_serving_base(folder)
        typer.echo(f"{folder}: no versions")
        return
    typer.echo(f"{'step':>12}  {'written':<20}  {'size':>9}  {'kind':<13}  file")
    for entry in entries:
        mark = "  <- LATEST" if entry.latest else ""
        size = entry.size if entry.member_bytes is None else entry.size + entry.member_bytes
        shards = "" if entry.members is None else f"  ({entry.members} members, index {human_bytes(entry.size)})"
        base = "" if not entry.base else f"  (base {entry.base}{'' if entry.base in listed else ', missing'})"
        if entry.not_file is not None:  # never opened: a FIFO would block, a link lead out of the folder
            typer.echo(printable(f"{entry.step:>12}  {'-':<20}  {'-':>9}  {entry.kind:<13}  {entry.name}  "
                                 f"({entry.not_file}: no reader opens it){mark}"))
            continue
        typer.echo(f"{entry.step:>12}  {entry.modified}  {human_bytes(size):>9}  {entry.kind:<13}  "
                   f"{entry.name}{shards}{base}{mark}")


def follow(
    folder: Folder,
    timeout: Annotated[float | None, typer.Option("--timeout", min=0.0, max=threading.TIMEOUT_MAX,
                                                  help="Stop after this many seconds without a new version.")] = None,
    after: Annotated[int | None, typer.Option("--after", min=0, help="Only versions with a step above this one (starting from the latest, as always).")] = None,
    poll: Annotated[float, typer.Option("--poll", min=0.0, max=threading.TIMEOUT_MAX,
                                        help="Seconds between looks at LATEST (at first, "
                                             "and again after each new version).")] = DEFAULT_POLL,
    max_poll: Annotated[float | None, typer.Option("--max-poll", min=0.0, max=threading.TIMEOUT_MAX,
                                                   help="Back off to this many seconds "
                                                   "between looks while nothing is published (default 4x --poll; "
                                                   "equal to --poll for a fixed interval).")] = None,
    notifications: Annotated[str | None, typer.Option("--notifications", help="An SQS queue URL the bucket's "
                                                      "event notifications feed: look at once when LATEST is "
                                                      "written (polling goes on as well).")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait for FOLDER to appear, rather than refuse a folder "
                                                      "that does not exist (yet).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print each version as one JSON object on its line.")] = False,
) -> None:
    """Print each new version of FOLDER as it lands (the latest one first), one per line.

    A path's control characters are shown escaped (\\n, \\x1b), as ws ls shows them; --json
    gives each path exactly.

    A FOLDER that does not exist is refused (exit 1, naming it): a mistyped path would
    otherwise wait forever. Pass --wait when it is only not there yet (a trainer about to
    publish its first version). A folder with no version yet, or none above --after, is
    said once on stderr (what it waits for), and waited on. A storage outage is waited out, from the start on (a
    connection refused too: a stopped server and a mistyped port look the same), and said
    on stderr once when it starts and once when it ends; a failure that stays (credentials
    refused, a host name that names no host) exits 1.

    \b
    Example:
      ws follow s3://bucket/run --after 1000 --timeout 600
    """
    from weightstore.sync._folder import check_notifications, require_folder, versions_folder
    from weightstore.sync._follow import PointerWatch, following

    as_json = settings.json = settings.json or as_json  # so a failure is reported as JSON too
    try:
        check_notifications(versions_folder(folder), notifications)
    except ValueError as exc:  # a usage error, as --poll's range is
        raise typer.BadParameter(str(exc), param_hint="--notifications") from None
    _refuse_serving_base(folder)  # numbered SavedModel folders are never ws.publish's
    if not wait:
        try:
            require_folder(folder, hint="pass --wait to wait for it to appear")
        except StorageError as exc:  # whether it exists cannot be told now: an outage, which the follow says and
            if not exc.transient:  # waits out
                raise
    watch = PointerWatch(versions_folder(folder), poll, max_poll, notifications)
    for version in following(watch, timeout, after, waiting=functools.partial(_say_what_it_waits_for, folder, after)):
        if as_json:  # a stream: one object per line, so a reader can act on each as it lands
            typer.echo(json.dumps({"command": "follow", "ok": True, "step": version.step, "path": version.path,
                                   "created": version.created, "metadata": version.metadata}, ensure_ascii=False))
        else:  # escaped as every command shows a path: raw, a newline splits the line and click strips a
            typer.echo(f"{version.step}\t{printable(version.path)}")  # terminal's escapes, naming another folder


def _say_what_it_waits_for(folder: str, after: int | None, named: int | None) -> None:
    """A follow whose first look finds nothing to print (no version yet, ``named`` ``None``; or
    none above ``--after``) waits in silence, which looks like a hang: said once on stderr, as a
    status line (``--quiet`` silences it; a name's control characters are escaped). A local
    folder that does not exist the follow has said already."""
    from weightstore.io.folders import LocalFolder
    from weightstore.sync._folder import versions_folder

    source = versions_folder(folder)
    above = "" if after is None else f" above step {after}"
    if named is None and not (isinstance(source, LocalFolder) and not source.exists()):
        note(f"weightstore: following {folder}: no version yet; waiting for its first version{above}")
    elif named is not None:
        note(f"weightstore: following {folder}: its latest version is step {named}; waiting for a version{above}")


def _refuse_serving_base(folder: str) -> None:
    """A TF Serving model base (``base/1/``, ``base/2/``) holds SavedModels, not ``ws.publish``
    versions: say so, rather than "no versions" or a follow that waits forever."""
    import os

    from weightstore.errors import FormatError
    from weightstore.formats.tf_checkpoint import serving_versions

    versions = serving_versions(folder) if os.path.isdir(folder) else []
    if versions:
        raise FormatError(f"is a TF Serving model base (SavedModel versions {', '.join(map(str, versions))}), not a "
                          f"folder of ws.publish versions; read one version with ws ls {os.path.join(folder, str(versions[-1]))}",
                          path=folder)


def clean(
    folder: Folder,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was removed as one JSON object.")] = False,
) -> None:
    """Remove what dead writers and coordinators left in FOLDER: attempt folders of sharded
    versions that no index names, rank files in an index's attempt folder that it does not
    name, indexes LATEST never reached, and (on S3) the unfinished uploads of killed writers.
    Run it while no job publishes to FOLDER.

    \b
    Example:
      ws clean s3://bucket/run
    """
    from weightstore.sharded._shards import clean_folder

    settings.json = settings.json or as_json
    with warnings.catch_warnings(record=True) as said:  # what clean keeps, and why: reported below
        warnings.simplefilter("always")
        removed = clean_folder(folder)
    kept = [str(warning.message) for warning in said]
    if settings.json:
        emit("clean", {"folder": folder, "removed": removed, "kept": kept})
        return
    typer.echo(f"{folder}: removed {len(removed)}" + "".join(f"\n  {name}" for name in removed)
               + "".join(f"\nkept {line}" for line in kept))
