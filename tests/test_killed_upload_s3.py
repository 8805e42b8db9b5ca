"""A writer killed mid-upload on S3 leaves a multipart upload that S3 keeps, unseen and billed,
until someone aborts it: the next publish to the folder (the restarted trainer's, on any host),
the commit of a relaunched sharded step, or ``ws clean`` of the folder at rest does."""

import concurrent.futures
import json
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

RANK = textwrap.dedent("""
    import sys
    import numpy as np
    import weightstore as ws
    folder, rank, attempt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rows = np.full((1, 5 << 20), rank, np.float32)  # 20 MB a rank
    ws.publish_shard(folder, {"w": ws.Piece(rows, (rank, 0), (2, 5 << 20))}, step=1, rank=rank, world=2,
                     attempt=attempt)
    if rank == 0 and attempt == 1:
        print(ws.commit_shards(folder, step=1, world=2, attempt=attempt, timeout=60).step)
""")


def unfinished_uploads(folder: str) -> list[str]:
    import s3fs

    bucket, prefix = folder[len("s3://"):].split("/", 1)
    listed = s3fs.S3FileSystem().call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
    return [upload["Key"][len(prefix) + 1:] for upload in listed.get("Uploads", [])]


def run(s3, script: str, *argv: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **s3.environment(), "PYTHONPATH": str(ROOT), **env})


def killed_mid_upload(s3, script: str, *argv: str, of: str, **env: str) -> None:
    """Run ``script`` and SIGKILL it once its first upload part of an object whose path holds
    ``of`` reaches the server (held there, never stored)."""
    part_arrived, killed = threading.Event(), threading.Event()

    def hold_the_first_part(environ):
        if environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in environ.get("QUERY_STRING", "") \
                and of in environ["PATH_INFO"]:
            part_arrived.set()
            killed.wait(60)
            return DOWN  # to nobody: the writer is dead
        return None

    s3.intercept = hold_the_first_part
    writer = run(s3, script, *argv, **env)
    try:
        assert part_arrived.wait(60), writer.stderr.read() if writer.poll() is not None else "no part uploaded"
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(60) == -signal.SIGKILL
    finally:
        killed.set()
        writer.kill()
        writer.communicate()
    s3.intercept = None


def test_a_publish_aborts_the_upload_a_publisher_killed_mid_way_left(s3, caplog):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    killed_mid_upload(s3, PUBLISHER, folder, of="step-000000000002")
    assert unfinished_uploads(folder) == ["step-000000000002.npz"]  # what S3 keeps of the killed upload
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        assert ws.publish(folder, {"w": np.full(4, 3, np.float32)}, step=3).step == 3  # the restarted trainer
    assert unfinished_uploads(folder) == []
    assert "aborted the unfinished upload of step-000000000002.npz, which a killed publish of step 2 left" in caplog.text
    assert [version.step for version in ws.sync.list_versions(folder)] == [1, 3]


def test_the_next_process_to_upload_removes_a_killed_publishers_copy_of_its_version_and_keeps_a_live_ones(
        s3, tmp_path):
    """A version for S3 is written whole into a scratch folder of ``TMPDIR``, then uploaded: a
    publisher killed mid-upload left that copy, the model's size, at every kill, and no restart
    removed it. The first upload of the next process removes a dead writer's, never a live one's
    (held here mid-upload while the other publishes)."""
    scratch, folder = tmp_path / "tmp", f"s3://{BUCKET}/{uuid.uuid4().hex}"
    scratch.mkdir()
    killed_mid_upload(s3, PUBLISHER, f"{folder}/a", of="/a/step-", TMPDIR=str(scratch))
    [left] = scratch.iterdir()
    assert (left / "upload.npz").stat().st_size > 20 << 20  # the killed publisher's copy of step 2
    part_arrived, go_on = threading.Event(), threading.Event()

    def hold_the_first_part(environ):
        if environ["REQUEST_METHOD"] == "PUT" and "partNumber=1&" in environ.get("QUERY_STRING", "") + "&" \
                and "/b/step-" in environ["PATH_INFO"]:
            part_arrived.set()
            go_on.wait(60)
        return None

    s3.intercept = hold_the_first_part
    live = run(s3, PUBLISHER, f"{folder}/b", TMPDIR=str(scratch))
    try:
        assert part_arrived.wait(60), live.stderr.read() if live.poll() is not None else "no part uploaded"
        later = run(s3, PUBLISHER, f"{folder}/c", TMPDIR=str(scratch))
        assert later.wait(60) == 0, later.communicate()
        assert [path.name.split("-")[2] for path in scratch.iterdir()] == [str(live.pid)]
    finally:
        go_on.set()
        s3.intercept = None
        live.communicate(timeout=60)
    assert live.returncode == 0
    assert list(scratch.iterdir()) == []  # each live one removes its own as its upload ends
    assert ws.load(ws.latest(f"{folder}/b").path)["w"].shape == (5 << 20,)


@pytest.mark.slow  # ranks killed and relaunched
def test_the_commit_of_a_relaunched_step_aborts_the_upload_a_killed_rank_left(s3, caplog):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    first = run(s3, RANK, folder, "0", "0")
    killed_mid_upload(s3, RANK, folder, "1", "0", of="rank-00001")
    assert first.wait(60) == 0, first.stderr
    assert unfinished_uploads(folder) == ["step-000000000001.attempt-0/rank-00001.safetensors"]
    relaunched = [run(s3, RANK, folder, str(rank), "1") for rank in (0, 1)]
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        outputs = [rank.communicate(timeout=120) for rank in relaunched]
    assert [rank.returncode for rank in relaunched] == [0, 0], outputs
    assert outputs[0][0].strip() == "1"
    assert "aborted the unfinished upload of step-000000000001.attempt-0/rank-00001.safetensors, which a killed " \
           "rank left" in outputs[0][1]
    assert unfinished_uploads(folder) == []
    assert ws.load(ws.latest(folder))["w"][1, -1] == 1


def test_ws_clean_aborts_what_killed_uploads_left_in_a_folder_at_rest(s3):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    killed_mid_upload(s3, PUBLISHER, folder, of="step-000000000002")
    clean = subprocess.run([sys.executable, "-m", "weightstore", "clean", folder, "--json"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, **s3.environment(), "PYTHONPATH": str(ROOT)})
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["removed"] == ["the unfinished upload of step-000000000002.npz"]
    assert unfinished_uploads(folder) == []
    assert ws.latest(folder).step == 1


def test_a_policy_that_refuses_listing_uploads_costs_the_publish_nothing_but_a_line(s3, caplog):
    """Without ``s3:ListBucketMultipartUploads`` the abort is refused: said once, and the publish
    still tidies the folder (the killed publish's intent removed, older versions pruned)."""
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    killed_mid_upload(s3, PUBLISHER, folder, of="step-000000000002")
    denied = (403, b"<Error><Code>AccessDenied</Code><Message>denied</Message></Error>")
    s3.intercept = lambda environ: denied if environ.get("QUERY_STRING", "").startswith("uploads") else None
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        for step in (3, 4, 5):
            assert ws.publish(folder, {"w": np.full(4, step, np.float32)}, step=step, keep=2).step == step
    s3.intercept = None
    assert caplog.text.count("unfinished uploads a killed writer may have left were not aborted") == 1
    assert [version.step for version in ws.sync.list_versions(folder)] == [4, 5]
    assert unfinished_uploads(folder) == ["step-000000000002.npz"]  # kept, as the line says


def test_a_publish_aborts_every_killed_upload_of_a_step_up_to_its_own(s3, caplog):
    """A trainer killed mid-upload twice in a row: the intent names only the second step, yet
    the first upload is as dead once the next publish's swap succeeded (no publisher can
    complete a step at or below the one ``LATEST`` names)."""
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    killed_mid_upload(s3, PUBLISHER, folder, of="step-000000000002")
    killed_mid_upload(s3, PUBLISHER.replace("step=2", "step=3"), folder, of="step-000000000003")
    assert unfinished_uploads(folder) == ["step-000000000002.npz", "step-000000000003.npz"]
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        assert ws.publish(folder, {"w": np.full(4, 4, np.float32)}, step=4).step == 4
    assert unfinished_uploads(folder) == []
    assert "aborted the unfinished upload of step-000000000002.npz, which a killed publish of step 2 left" in caplog.text


def test_a_folder_at_a_buckets_root_has_its_killed_uploads_aborted(s3):
    import s3fs

    bucket = f"weightstore-root-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    folder = f"s3://{bucket}"

    def left() -> list[str]:
        return [upload["Key"] for upload in
                s3fs.S3FileSystem().call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])]

    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    killed_mid_upload(s3, PUBLISHER, folder, of="step-000000000002")
    assert left() == ["step-000000000002.npz"]
    assert ws.publish(folder, {"w": np.full(4, 3, np.float32)}, step=3).step == 3
    assert left() == []
    killed_mid_upload(s3, PUBLISHER.replace("step=2", "step=4"), folder, of="step-000000000004")
    clean = subprocess.run([sys.executable, "-m", "weightstore", "clean", folder, "--json"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, **s3.environment(), "PYTHONPATH": str(ROOT)})
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["removed"] == ["the unfinished upload of step-000000000004.npz"]
    assert left() == []


def listing_page(bucket: str, keys: list[str], next_key: str) -> bytes:
    """A truncated ``ListMultipartUploads`` answer holding ``keys``, going on after ``next_key``."""
    uploads = "".join(f"<Upload><Key>{key}</Key><UploadId>live-{n}</UploadId></Upload>" for n, key in enumerate(keys))
    return (f'<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult><Bucket>{bucket}</Bucket>'
            f"<NextKeyMarker>{next_key}</NextKeyMarker><NextUploadIdMarker>live-0</NextUploadIdMarker>"
            f"<MaxUploads>1000</MaxUploads><IsTruncated>true</IsTruncated>{uploads}</ListMultipartUploadsResult>"
            ).encode()


def test_a_truncated_listing_of_uploads_is_followed_to_its_end_and_never_for_ever(s3, caplog):
    """The killed upload on a listing's second page is aborted; a service that answers every
    page truncated, never past the markers it was given, costs a logged line, not a publish
    that never returns."""
    name = uuid.uuid4().hex
    folder = f"s3://{BUCKET}/{name}"
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    killed_mid_upload(s3, PUBLISHER, folder, of="step-000000000002")
    asked = []

    def first_page_elsewhere(environ):
        query = environ.get("QUERY_STRING", "")
        if environ["REQUEST_METHOD"] == "GET" and query.startswith("uploads"):
            asked.append(query)
            if "key-marker" not in query:  # the second, and every later one, is the server's own
                return 200, listing_page(BUCKET, [f"{name}/a-live-upload"], f"{name}/a-live-upload")
        return None

    s3.intercept = first_page_elsewhere
    assert ws.publish(folder, {"w": np.full(4, 3, np.float32)}, step=3).step == 3
    s3.intercept = None
    assert len(asked) == 2 and f"key-marker={name}%2Fa-live-upload" in asked[1]
    assert unfinished_uploads(folder) == []

    killed_mid_upload(s3, PUBLISHER.replace("step=2", "step=4"), folder, of="step-000000000004")
    s3.intercept = lambda environ: (200, listing_page(BUCKET, [], f"{name}/a")) if (
        environ["REQUEST_METHOD"] == "GET" and environ.get("QUERY_STRING", "").startswith("uploads")) else None
    published = concurrent.futures.ThreadPoolExecutor(1).submit(ws.publish, folder, {"w": np.ones(4, np.float32)},
                                                                step=5)
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        assert published.result(timeout=60).step == 5
    s3.intercept = None
    assert "truncated but does not go on past" in caplog.text
    assert ws.latest(folder).step == 5


def test_a_slow_rank_of_a_dead_attempt_whose_upload_a_commit_aborted_is_told_so(s3):
    """A zombie rank still uploading into attempt 0 when the relaunch commits attempt 1: the
    commit aborts that upload, and the zombie's publish_shard says why its write failed."""
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    held, release = threading.Event(), threading.Event()

    def hold_the_zombies_part(environ):
        if environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in environ.get("QUERY_STRING", "") \
                and "attempt-0/rank-00001" in environ["PATH_INFO"] and not held.is_set():
            held.set()
            release.wait(60)
        return None

    def shard(rank: int, attempt: int) -> ws.Version | None:
        rows = np.full((1, 5 << 20), rank + 10 * attempt, np.float32)  # 20 MB: a multipart upload
        return ws.publish_shard(folder, {"w": ws.Piece(rows, (rank, 0), (2, 5 << 20))}, step=1, rank=rank, world=2,
                                attempt=attempt)

    s3.intercept = hold_the_zombies_part
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        zombie = [pool.submit(shard, rank, 0) for rank in (0, 1)]
        assert held.wait(60)
        for relaunched in [pool.submit(shard, rank, 1) for rank in (0, 1)]:
            relaunched.result(timeout=120)
        assert ws.commit_shards(folder, step=1, world=2, attempt=1, timeout=60).step == 1
        release.set()
        zombie[0].result(timeout=120)
        with pytest.raises(ws.WriteError, match="its upload was aborted while it was sent") as caught:
            zombie[1].result(timeout=120)
    s3.intercept = None
    assert "attempt-0/rank-00001.safetensors" in str(caught.value.path)
    assert ws.load(ws.latest(folder))["w"][1, -1] == 11
