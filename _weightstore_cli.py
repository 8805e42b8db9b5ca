"""The ``ws`` console script's entry: a Ctrl-C while Python is still importing weightstore.

Importing weightstore and the ``ws`` command takes about half a second, before any command
can handle Ctrl-C as it does (``cli/guard.py``: "interrupted", exit 130). Python's own
handling printed a traceback of whichever module it was importing, and a KeyboardInterrupt
raised inside an import can do worse: a weak reference's callback swallows it (the command
then runs on), or a C extension left half initialised crashes the exit. So while the imports
run, Ctrl-C ends the process at once, where nothing has been written yet; the commands get
Python's KeyboardInterrupt back, which their writes clean up after. The entry lives outside
the ``weightstore`` package, since importing anything inside it runs the package's imports
first.
"""

import os
import signal
import sys

INTERRUPTED = 130  # as a shell reports a process stopped by SIGINT


def main() -> None:
    try:
        starting = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not where Ctrl-C is ignored (ws &)
        if starting:
            signal.signal(signal.SIGINT, _exit_at_once)
        try:
            from weightstore.cli.main import main as ws
        finally:
            if starting:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        ws()
    except KeyboardInterrupt:  # typer building the command, before the command's own handling answers
        sys.stderr.write("interrupted\n")
        raise SystemExit(INTERRUPTED) from None


def _exit_at_once(signum: int, frame: object) -> None:
    os.write(2, b"interrupted\n")
    os._exit(INTERRUPTED)
