"""The ``ws`` console script's entry: a Ctrl-C while Python is still importing weightstore.

Importing weightstore and the ``ws`` command takes about half a second, before any command
can handle Ctrl-C as it does (``cli/guard.py``: "interrupted", exit 130). Python's own
handling printed a traceback of whichever module it was importing, and a KeyboardInterrupt
raised inside an import can do worse: a weak reference's callback swallows it (the command
then runs on), or a C extension left half initialised crashes the exit. So while the imports
run, Ctrl-C ends the process at once, where nothing has been written yet; the commands get
Python's KeyboardInterrupt back, which their writes clean up after, except where Python
swallows it (:func:`_swallowed_interrupt_ends_at_once`). The entry lives outside
the ``weightstore`` package, since importing anything inside it runs the package's imports
first. ``python -m weightstore`` imports the package before its ``__main__``: the package's
first lines call :func:`starting_as_module`, and ``__main__`` calls :func:`main`.
"""

import os
import signal
import sys

INTERRUPTED = 130  # as a shell reports a process stopped by SIGINT


def main() -> None:
    try:
        _swallowed_interrupt_ends_at_once()
        starting = _exit_at_once_while_starting()
        try:
            from weightstore.cli.main import main as ws
        finally:
            if starting:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        ws()
    except KeyboardInterrupt:  # typer building the command, before the command's own handling answers
        sys.stderr.write("interrupted\n")
        raise SystemExit(INTERRUPTED) from None
    except SystemExit as done:  # how every command ends
        _end_at_once_from_now_on(done.code)
        raise


def starting_as_module() -> None:
    """Called first thing by the package while Python imports it for ``python -m weightstore``,
    whose ``__main__`` then runs :func:`main`; a program that merely imports weightstore (``-m``
    of a module of its own included) keeps Python's handling."""
    if _module_run(sys.orig_argv) == "weightstore":
        _swallowed_interrupt_ends_at_once()
        _exit_at_once_while_starting()


def _module_run(argv: list[str]) -> str | None:
    """The module ``python -m MODULE`` runs, from the interpreter's own command line."""
    for at, arg in enumerate(argv[1:], 1):
        if arg == "-m":
            return argv[at + 1] if at + 1 < len(argv) else None
        if arg.startswith("-m"):
            return arg[2:]
    return None


def _exit_at_once_while_starting() -> bool:
    """Ctrl-C ends the process at once from now on, unless it is ignored (``ws &``) or handled
    otherwise; whether it does."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_at_once)
    return signal.getsignal(signal.SIGINT) is _exit_at_once


def _swallowed_interrupt_ends_at_once() -> None:
    """A Ctrl-C whose KeyboardInterrupt Python swallows ends the process at once, as while
    starting. Raised inside a weak reference's callback (the import machinery's: a command
    imports what it needs when it needs it), a garbage collection's or a ``__del__``, it is
    "ignored": Python prints it and the command runs on (``ws follow`` waited for ever, its
    user's Ctrl-C spent). Nothing of the command handles it any more: what it printed is
    flushed, and a temporary its write left is removed by the next write to that target."""
    passed_on = sys.unraisablehook

    def unraisable(seen: "sys.UnraisableHookArgs") -> None:
        if seen.exc_type is not None and issubclass(seen.exc_type, KeyboardInterrupt):
            _flush()
            _exit_at_once(signal.SIGINT, None)
        passed_on(seen)

    sys.unraisablehook = unraisable


def _end_at_once_from_now_on(code: object) -> None:
    """The command has ended and said so; what is left is Python's exit, which joins the threads
    of weightstore's pools (one perhaps in a read of a slow mount, for seconds). A Ctrl-C there
    printed a traceback of the join: from now on it ends the process at once, with the command's
    status, what it printed flushed first."""
    if not (code is None or isinstance(code, int)) or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    _flush()
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(code or 0))


def _flush() -> None:
    """What the command printed, out before the process ends without Python's exit."""
    import contextlib  # imported by the command already: none of the start's cost

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, or the stream closed: nothing can reach it
            stream.flush()


def _exit_at_once(signum: int, frame: object) -> None:
    os.write(2, b"interrupted\n")
    os._exit(INTERRUPTED)
