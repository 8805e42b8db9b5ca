"""The test harness's forked processes (tests/processes.py) behave as the interpreters they stand for."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from processes import ForkServer, fork_together

#: a script whose exit a real interpreter finishes: a non-daemon thread's last words, an atexit
#: hook's, and sys.exit's message on stderr
EXITING = textwrap.dedent("""
    import atexit, sys, threading, time
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished", flush=True))).start()
    sys.exit("leaving with a message")
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    forking = ForkServer(tmp_path_factory.mktemp("forked"), "import numpy")
    yield forking
    forking.close()


def test_a_child_reads_its_own_stdin_not_the_next_request(server):
    """The server read requests with read-ahead: a child's sys.stdin held the next request."""
    reader = server.start("import sys, time; time.sleep(0.5); print(repr(sys.stdin.read()))")
    after = server.start("print('second')")
    assert reader().stdout.strip() == "''"
    assert after().stdout.strip() == "second"


def test_children_waited_for_out_of_order_each_get_their_end(server):
    first = server.start("import time; time.sleep(0.3); print('first')")
    second = server.start("print('second')")
    assert second().stdout.strip() == "second"
    assert first().stdout.strip() == "first"  # its end, read while waiting for the second, was dropped


def test_a_forked_script_exits_as_an_interpreter_does(server, tmp_path):
    real = subprocess.run([sys.executable, "-c", EXITING], capture_output=True, text=True, timeout=60)
    forked = server.run(EXITING)
    ranks = fork_together("import numpy", EXITING, [[]], [dict(os.environ)], timeout=60)
    assert real.returncode == 1 and real.stdout.splitlines() == ["thread finished", "atexit ran"]
    assert real.stderr.strip() == "leaving with a message"
    for result in (forked, *ranks):
        assert (result.returncode, result.stdout, result.stderr.strip()) == (1, real.stdout, real.stderr.strip())
