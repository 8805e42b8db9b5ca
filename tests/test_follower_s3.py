"""A Follower serving from S3: moto's server on 127.0.0.1, the real s3fs client, a real Keras model."""

from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import weightstore as ws  # noqa: E402
from benchmarks.s3_server import CountingS3, restore_environment, use_environment  # noqa: E402
from weightstore.adapters.follower import Follower  # noqa: E402

BUCKET = "weightstore-follower"


@pytest.fixture(scope="module")
def server():
    import s3fs

    server = CountingS3().start()
    saved = use_environment(server)
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir(BUCKET)
    try:
        yield server
    finally:
        server.intercept = None
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
        restore_environment(saved)


@pytest.fixture
def s3(server):
    server.intercept = None
    server.reset()
    yield server
    server.intercept = None


@pytest.fixture
def folder(s3) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, name="hidden"), keras.layers.Dense(1, name="out")])


def weights_at(model: keras.Model, step: int) -> dict[str, np.ndarray]:
    from weightstore.adapters import tf2

    return {key: np.full(value.shape, step, value.dtype) for key, value in tf2.export(model).items()}


def test_serving_is_not_held_while_a_version_downloads(s3, folder, model):
    ws.publish(folder, weights_at(model, 1), step=1)
    fetching, gate = threading.Event(), threading.Event()

    def hold_the_tensor_data(environ):
        """Hold every read of step 2's tensors: from its first bytes (the index, read at once, is at its end)."""
        if (environ["REQUEST_METHOD"] == "GET" and "step-000000000002" in environ.get("PATH_INFO", "")
                and environ.get("HTTP_RANGE", "").startswith("bytes=0-")):
            fetching.set()
            gate.wait(30)
        return None

    with Follower(model, folder, poll=0.01) as follower:
        assert follower.wait(1, timeout=30).step == 1
        s3.intercept = hold_the_tensor_data
        ws.publish(folder, weights_at(model, 2), step=2)
        try:
            assert fetching.wait(30), "the follower never fetched step 2"
            entered = threading.Event()

            def serve() -> None:
                with follower.reading():
                    entered.set()

            start = time.monotonic()
            reader = threading.Thread(target=serve)
            reader.start()
            reader.join(5)
            assert entered.is_set(), "reading() waited on the download"
            assert time.monotonic() - start < 5
            assert follower.version.step == 1  # still serving the old version, whole
            assert np.all(model.get_layer("hidden").kernel.numpy() == 1)
        finally:
            gate.set()
        assert follower.wait(2, timeout=30).step == 2
        assert np.all(model.get_layer("hidden").kernel.numpy() == 2) and follower.error is None
