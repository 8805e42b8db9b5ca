"""A trainer killed mid-upload on S3 leaves a multipart upload that S3 keeps, unseen and billed,
until someone aborts it: the next publish to the folder (its restart, on any host) does."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

import weightstore as ws

pytest.importorskip("s3fs")

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "weightstore-killed-upload"
DOWN = (503, b"<Error><Code>SlowDown</Code><Message>down</Message></Error>")

PUBLISHER = textwrap.dedent("""
    import sys
    import numpy as np
    import weightstore as ws
    ws.publish(sys.argv[1], {"w": np.ones(5 << 20, np.float32)}, step=2)  # 20 MB: a multipart upload
""")


def unfinished_uploads(folder: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem()
    bucket, prefix = folder[len("s3://"):].split("/", 1)
    listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
    return [upload["Key"].rsplit("/", 1)[-1] for upload in listed.get("Uploads", [])]


def test_a_publish_aborts_the_upload_a_publisher_killed_mid_way_left(s3, caplog):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    part_arrived, killed = threading.Event(), threading.Event()

    def hold_the_first_part(environ):
        if environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in environ.get("QUERY_STRING", ""):
            part_arrived.set()
            killed.wait(60)
            return DOWN  # to nobody: the publisher is dead
        return None

    s3.intercept = hold_the_first_part
    publisher = subprocess.Popen([sys.executable, "-c", PUBLISHER, folder], stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, **s3.environment(), "PYTHONPATH": str(ROOT)})
    try:
        assert part_arrived.wait(60), publisher.stderr.read() if publisher.poll() is not None else "no part uploaded"
        publisher.send_signal(signal.SIGKILL)
        assert publisher.wait(60) == -signal.SIGKILL
    finally:
        killed.set()
        publisher.kill()
        publisher.wait()
    s3.intercept = None
    assert unfinished_uploads(folder) == ["step-000000000002.npz"]  # what S3 keeps of the killed upload

    with caplog.at_level(logging.WARNING, logger="weightstore"):
        assert ws.publish(folder, {"w": np.full(4, 3, np.float32)}, step=3).step == 3  # the restarted trainer
    assert unfinished_uploads(folder) == []
    assert "aborted the unfinished upload of step-000000000002.npz, which a killed publish of step 2 left" in caplog.text
    assert [version.step for version in ws.sync.list_versions(folder)] == [1, 3]
