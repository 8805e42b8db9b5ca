"""Turn every failure of every command into one line on stderr and its exit status.

The guard sits on the command group, not on ``main()``, so it covers commands other modules
register (``cli/sync.py``) and holds under ``typer.testing.CliRunner`` exactly as it does
for the installed ``ws``. A failure exits 1, except where a command's answer is 1
(:data:`ANSWERS`); usage errors stay typer's (exit 2); ``--debug`` lets the exception
through with its traceback. Output into a pipe whose reader went (``ws ls m.npz | head -1``)
ends the command quietly, exit :data:`PIPE_CLOSED`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperGroup
from typer.exceptions import Abort, Exit, TyperException

from weightstore.cli import render
from weightstore.errors import FormatError, WeightStoreError

FAILED = 1
#: a usage error (typer's own), and a failure of a command in :data:`ANSWERS`
TROUBLE = 2
INTERRUPTED = 130
#: the reader of the output went away (``ws ls big.npz | head -1``): what a shell shows for ``ls``
#: there, stopped by SIGPIPE (128 + 13), never one of a command's answers (``diff``'s 1 is "different")
PIPE_CLOSED = 141
#: the commands that answer a question about files exit as ``diff`` and ``cmp`` do: 0 yes (equal,
#: intact), 1 no (different, corrupt), :data:`TROUBLE` when they cannot tell, so a script can tell
#: the answer from a failure; mapped to the errors that are their "no" (a damaged file is what
#: ``verify`` looks for, but leaves ``diff`` unable to compare)
ANSWERS: dict[str, tuple[type[Exception], ...]] = {"diff": (), "verify": (FormatError,)}
#: flags of the group that may also be written after the subcommand (``ws ls m.npz -q``)
GLOBAL_FLAGS = frozenset({"--quiet", "-q", "--debug"})
#: ``ctx.meta`` key: the command line asked for ``--json``, known before any option is parsed
_JSON_ASKED = "weightstore.json"


def describe(exc: BaseException) -> str:
    """One line saying what went wrong, naming the file when the error knows it. A name holding
    a newline is shown escaped (``new\\nline.npz``), as ``ws ls`` shows it, not cut into two of
    the line's parts; and no character of the line is one a terminal would act on."""
    if isinstance(exc, WeightStoreError):
        text = str(exc) if not exc.path else str(exc).replace(exc.path, render.printable(exc.path))
    elif isinstance(exc, OSError) and exc.filename is not None:
        text = f"{render.printable(str(exc.filename))}: {exc.strerror or exc}"
    elif isinstance(exc, OSError):
        text = str(exc)
    else:
        text = f"internal error ({type(exc).__name__}: {exc}); run with --debug for the traceback"
    return render.printable(one_line(text)) or type(exc).__name__


def one_line(text: str) -> str:
    """A multi-line message (an assign's sections, a layout's refusals) on one line, its lines
    kept apart by "; " (after a line ending in ":", by a space) rather than run together."""
    joined = ""
    for line in (line.strip() for line in text.splitlines()):
        if line:
            joined = line if not joined else f"{joined}{' ' if joined.endswith(':') else '; '}{line}"
    return " ".join(joined.split())


def failure_status(command: str | None, exc: BaseException) -> int:
    """The exit status of ``command`` failing with ``exc``: 1, or 2 where 1 is the command's answer."""
    if command not in ANSWERS or isinstance(exc, ANSWERS[command]):
        return FAILED
    return TROUBLE


def json_asked(ctx: typer.Context) -> bool:
    """Whether the command line holds ``--json``, for what answers before options are parsed
    (a usage error, ``--version``)."""
    return bool(ctx.meta.get(_JSON_ASKED))


def _usage_error_as_json(ctx: typer.Context, exc: TyperException) -> None:
    """A usage error (exit 2): click prints the usage on stderr, and ``--json`` still gets its
    object on stdout, so a script parsing it never finds it empty."""
    if json_asked(ctx) and hasattr(exc, "format_message"):
        render.print_json(render.error_document(ctx.invoked_subcommand, exc, exc.format_message()))


def hoist_global_flags(args: list[str]) -> list[str]:
    """``args`` with the group's flags moved in front of the subcommand, where click looks for them.

    People type ``ws ls m.npz -q`` as often as ``ws -q ls m.npz``; click only reads group options
    before the subcommand. Nothing after a ``--`` is touched.
    """
    options = _before_double_dash(args)
    flags = [arg for arg in options if arg in GLOBAL_FLAGS]
    return flags + [arg for arg in options if arg not in GLOBAL_FLAGS] + args[len(options):]


def _before_double_dash(args: list[str]) -> list[str]:
    """The arguments that may be options: those before a ``--``, after which all are operands."""
    return args[: args.index("--")] if "--" in args else args


def _caused_by_interrupt(exc: BaseException) -> bool:
    """Whether a Ctrl-C is what ``exc`` wraps: Python 3.11 reports one that came while a class
    was being made (a ``cached_property``'s ``__set_name__``, as a command imports the modules it
    uses) as a RuntimeError caused by the KeyboardInterrupt, which read as an internal error."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _interrupted() -> Exit:
    """Ctrl-C: said in one word, exit 130 (``_weightstore_cli`` says it so while ``ws`` starts)."""
    typer.echo("interrupted", err=True)
    return Exit(INTERRUPTED)


def _is_closed_pipe(exc: BaseException) -> bool:
    """Whether ``exc`` is the output's reader gone: an EPIPE of the command's own printing, never a
    weightstore error (a write the file system refused keeps its ``errno``, EPIPE included)."""
    return isinstance(exc, OSError) and not isinstance(exc, WeightStoreError) and exc.errno == errno.EPIPE


def _pipe_closed() -> Exit:
    """The reader of stdout (or stderr) stopped reading, as ``head`` does after its lines: end at
    once, saying nothing, as ``ls | head`` does. typer and rich said nothing either but exited 1,
    which a script reads as a failure (from ``ws diff``, as "different"). Nothing more can reach
    that reader, and Python's last flush at exit would complain of the pipe: both streams now
    write to the null device, as Python's documentation of SIGPIPE has it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):  # a stream of no file (CliRunner's)
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)
    return Exit(PIPE_CLOSED)


def _raise_closed_pipe(self: Console) -> None:
    """rich's answer to a closed pipe, for every console of the command (its tables, typer's help
    and error boxes): raised as Python raises it, for :func:`_pipe_closed` to answer, where rich
    would exit 1 itself."""
    raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


class GuardedGroup(TyperGroup):
    """A typer group whose subcommands fail with one line instead of a traceback."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        rich_answer = Console.on_broken_pipe
        Console.on_broken_pipe = _raise_closed_pipe  # type: ignore[method-assign]
        try:
            return super().main(*args, **kwargs)
        except BrokenPipeError:  # typer printing a usage error, after the guard let it go
            _pipe_closed()
            raise SystemExit(PIPE_CLOSED) from None
        finally:
            Console.on_broken_pipe = rich_answer  # type: ignore[method-assign]

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        ctx.meta[_JSON_ASKED] = "--json" in _before_double_dash(args)  # before parsing, which a usage error stops
        try:
            return super().parse_args(ctx, hoist_global_flags(list(args)))
        except TyperException as exc:  # a usage error of ``ws`` itself (``ws --bogus ls``)
            _usage_error_as_json(ctx, exc)
            raise
        except KeyboardInterrupt:  # typer imports what converts the values here (a quarter second)
            raise _interrupted() from None
        except OSError as exc:  # ``ws --help | head -1``, ``ws --version | true``
            if _is_closed_pipe(exc):
                raise _pipe_closed() from None
            raise

    def invoke(self, ctx: typer.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except TyperException as exc:  # a usage error of a command
            _usage_error_as_json(ctx, exc)
            raise
        except (Exit, Abort):
            raise  # deliberate exits
        except KeyboardInterrupt:
            raise _interrupted() from None
        except Exception as exc:
            if _caused_by_interrupt(exc):
                raise _interrupted() from None
            if _is_closed_pipe(exc):
                raise _pipe_closed() from None
            if ctx.params.get("debug"):
                raise  # typer's own handler: a traceback
            message = describe(exc)
            if render.settings.json:
                render.print_json(render.error_document(ctx.invoked_subcommand, exc, message))
            typer.echo(f"error: {message}", err=True)
            raise Exit(failure_status(ctx.invoked_subcommand, exc)) from None
        finally:
            render.settings.reset()  # the next invocation in this process (tests, embedding) starts afresh
