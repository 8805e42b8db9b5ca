"""Shared test set-up: quiet TensorFlow, and the fixtures more than one test module uses."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches the processes the tests start: a shell without job control (a script's
    ``./tasks test &``, some CI runners) starts its background commands with SIGINT ignored, which
    every process after inherits, Python included (it installs no handler then), so the tests that
    interrupt a trainer or ``ws`` waited for an exit that never came. Python's own handler here
    puts the default back in each process started from this one.

    The controller of an xdist run writes pytest's cache of the test modules' rewritten asserts
    before its workers start: each worker imports every test module to collect it, and the
    rewrite (4 CPU-s for this suite's modules) ran in each at once on a fresh clone, none cached
    yet; they read it whether or not they may write bytecode. Written only where bytecode may be
    written, as pytest writes it (``./tasks test`` lets it be)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput") \
            and not sys.dont_write_bytecode:
        _cache_rewritten_asserts(config)


def _cache_rewritten_asserts(config: pytest.Config) -> None:
    """What pytest's import hook does for a test module it finds no cache for, done for each
    ahead of the import (pytest's private functions: nothing is done if they are not there; the
    workers then rewrite as before). Its cache is keyed by the source's hash, so a stale one is
    never read."""
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        for source in [Path(__file__), *sorted(Path(__file__).parent.glob("test_*.py"))]:
            cache = rewrite.get_cache_dir(source)
            pyc = cache / (source.name[:-3] + rewrite.PYC_TAIL)
            if rewrite._read_pyc(source, pyc) is None and rewrite.try_makedirs(cache):
                source_hash, code = rewrite._rewrite_test(source, config)
                rewrite._write_pyc(state, code, source_hash, pyc)
    except (AttributeError, ImportError, KeyError, TypeError, SyntaxError):
        return  # a module that does not compile fails in the workers, where its tests are reported


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a ``slow`` test run first, each file's tests together and in their order:
    ``./tasks test``'s workers take whole files in collection order, and the heaviest files sort
    last by name (``test_shards_*``, ``test_tf_*``), so a run ended on one worker's long tail."""
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in heavy)  # stable: the order within each group stays


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Checkpoints TF1, TF2 and Keras really write (see ``tf_files.make_all``), made once per module."""
    pytest.importorskip("tensorflow")
    import tf_files

    return tf_files.make_all(tmp_path_factory.mktemp("made"))


@pytest.fixture(scope="module")
def server(request):
    """A counting S3 server on a loopback port (``benchmarks.s3_server.CountingS3``) that this
    process's S3 clients use for plain ``s3://`` URLs, with the test module's ``BUCKET`` made."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import s3fs

    from benchmarks.s3_server import CountingS3, restore_environment, use_environment

    server = CountingS3().start()
    saved = use_environment(server)
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir(request.module.BUCKET)
    try:
        yield server
    finally:
        server.intercept = None
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
        restore_environment(saved)


@pytest.fixture
def s3(server):
    """The :func:`server` with its record cleared and no request intercepted, for one test."""
    server.intercept = None
    server.reset()
    yield server
    server.intercept = None


@pytest.fixture(scope="session")
def tf_fork(tmp_path_factory):
    """A ``processes.ForkServer`` of this worker whose children start with TensorFlow and Keras
    imported (no op run, no model built): ``tf_fork.run(script, *argv, cwd=, env=, timeout=)``
    gives a script's exit code and output as ``subprocess.run`` does, without a TensorFlow import
    per process. Its environment is x86 TensorFlow's default, which a user's process gets (this
    file turns oneDNN off for the tests' own processes)."""
    if importlib.util.find_spec("tensorflow") is None:  # found, not imported: the children import it
        pytest.skip("tensorflow is not installed")
    import processes

    server = processes.ForkServer(tmp_path_factory.mktemp("forked"), "import numpy, tensorflow, keras, weightstore",
                                  env={"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "1"})
    try:
        yield server
    finally:
        server.close()
