"""TensorFlow imported without its start-up chatter under the ``ws`` command.

Apart from :mod:`._checkpoints`, which imports TensorFlow, so that every ``ws`` command can ask
for silence before it parses its arguments without importing the formats TensorFlow's
checkpoints need (``ws --version`` and ``ws ls m.npz`` never read one).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_silent = False


def silence_tensorflow() -> None:
    """Keep TensorFlow's start-up chatter off stderr, where the CLI promises one-line errors.

    Some of it is printed by native code before any logging setting applies, so the import
    itself runs with file descriptor 2 pointed at ``/dev/null``; the log level is forced, not
    defaulted, since a ``TF_CPP_MIN_LOG_LEVEL=0`` left in a shell would otherwise bring the C++
    lines back (``ws --debug`` shows them).
    """
    global _silent
    _silent = True
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    """File descriptor 2 on ``/dev/null`` when the CLI silenced TensorFlow (see :func:`silence_tensorflow`)."""
    if not _silent:
        yield
        return
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
