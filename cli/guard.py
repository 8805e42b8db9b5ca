"""Turn every failure of every command into one line on stderr and exit status 1.

The guard sits on the command group, not on ``main()``, so it covers commands other modules
register (``cli/sync.py``) and holds under ``typer.testing.CliRunner`` exactly as it does
for the installed ``ws``. Usage errors stay typer's (exit 2); ``--debug`` lets the
exception through with its traceback.
"""

from __future__ import annotations

import errno

import typer
from typer.core import TyperGroup
from typer.exceptions import Abort, Exit, TyperException

from weightstore.errors import WeightStoreError

INTERRUPTED = 130


def describe(exc: BaseException) -> str:
    """One line saying what went wrong, naming the file when the error knows it."""
    if isinstance(exc, WeightStoreError):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror or exc}"
    elif isinstance(exc, OSError):
        text = str(exc)
    else:
        text = f"internal error ({type(exc).__name__}: {exc}); run with --debug for the traceback"
    return " ".join(text.split()) or type(exc).__name__


class GuardedGroup(TyperGroup):
    """A typer group whose subcommands fail with one line instead of a traceback."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (TyperException, Exit, Abort):
            raise  # usage errors (exit 2) and deliberate exits
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise Exit(INTERRUPTED) from None
        except Exception as exc:
            if ctx.params.get("debug") or (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
                raise  # typer's own handler: a traceback, or a quiet exit when a pipe closes
            typer.echo(f"error: {describe(exc)}", err=True)
            raise Exit(1) from None
