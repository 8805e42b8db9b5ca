"""Shared test set-up: quiet TensorFlow, and the fixtures more than one test module uses."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Checkpoints TF1, TF2 and Keras really write (see ``tf_files.make_all``), made once per module."""
    pytest.importorskip("tensorflow")
    import tf_files

    return tf_files.make_all(tmp_path_factory.mktemp("made"))
