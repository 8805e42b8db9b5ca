"""Several ``ws`` commands run in turn by one Python process, each as the ``ws`` script runs it
(its entry, the real commands), its exit status, stdout and stderr kept apart from the others'.

A test of many commands paid Python's start-up for each, and TensorFlow's import for each that
writes a TF checkpoint; the commands themselves are the same code either way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

_IN_TURN = """
import json, os, resource, signal, sys, tempfile
limit = json.loads(sys.argv[2])
if limit is not None:  # writes past it fail (EFBIG), as on a file system that refused them
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from _weightstore_cli import main
done = []
for args in json.loads(sys.argv[1]):
    sys.argv = ["ws", *args]
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        saved = [os.dup(1), os.dup(2)]
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        try:
            main()
            status = 0
        except SystemExit as exit:
            status = exit.code or 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, kept in enumerate(saved, 1):
                os.dup2(kept, fd)
                os.close(kept)
        stdout.seek(0)
        stderr.seek(0)
        done.append([status, stdout.read(), stderr.read()])
print(json.dumps(done))
"""


def ws_in_turn(commands: Sequence[Sequence[object]], *, file_size_limit: int | None = None,
               timeout: float = 240) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each command, run in turn by one process whose writes past
    ``file_size_limit`` bytes fail, if given. A command that ends any other way than ``ws``
    ends (a traceback) fails the call."""
    ran = subprocess.run([sys.executable, "-c", _IN_TURN, json.dumps([[str(arg) for arg in args] for args in commands]),
                          json.dumps(file_size_limit)], capture_output=True, text=True, timeout=timeout)
    assert ran.returncode == 0, ran.stderr
    return [(status, stdout, stderr) for status, stdout, stderr in json.loads(ran.stdout)]
