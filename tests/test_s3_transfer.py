"""What crosses the wire to S3: requests and bytes counted at a real moto server on 127.0.0.1,
read and written through the real s3fs client with plain ``s3://`` URLs."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import uuid

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import weightstore as ws
from weightstore.io import commit, objects, remote
from weightstore.io._buffer import memory_owner

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")


BUCKET = "weightstore-transfer"
FORMATS = [".npz", ".safetensors"]
#: 4 scopes of 4 tensors of 128 KB: one scope is 512 KB, the file 2 MB
WEIGHTS = {f"block_{s}/w{t}": np.random.default_rng(4 * s + t).standard_normal((128, 256)).astype(np.float32)
           for s in range(4) for t in range(4)}


def url(suffix: str) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}/w{suffix}"


def put(target: str, data: bytes) -> None:
    import s3fs

    s3fs.S3FileSystem().pipe_file(target[len("s3://"):], data)


def get(target: str) -> bytes:
    import s3fs

    return s3fs.S3FileSystem().cat_file(target[len("s3://"):])


def same(loaded: dict, expected: dict) -> bool:
    return list(loaded) == list(expected) and all(np.array_equal(loaded[k], expected[k]) for k in expected)


# -- what an open and a load cost ---------------------------------------------------------------

@pytest.mark.parametrize("suffix", FORMATS)
def test_open_costs_one_request(s3, suffix):
    target = url(suffix)
    ws.save(target, WEIGHTS, metadata={"run": 1})
    s3.reset()
    with ws.open(target) as store:
        assert store.metadata == {"run": 1} and store.keys() == list(WEIGHTS)
        assert [r.method for r in s3.requests] == ["GET"], s3.requests
        assert s3.bytes_sent() <= remote.INDEX_WINDOW


@pytest.mark.parametrize("count", [1500, 20_000])
def test_an_index_larger_than_the_window_costs_a_second_request(s3, count):
    """One request more, whether the window held the directory (the manifest then comes as the
    directory says) or not (grown to take in the manifest too); within twice the index's bytes."""
    target = url(".npz")
    many = {f"layer_{i:05d}/bias": np.full((2,), i, np.float32) for i in range(count)}
    ws.save(target, many)
    data = get(target)
    index_bytes = len(data) - data.rfind(b"PK\x03\x04")  # the manifest (the last member) to the end
    s3.reset()
    with ws.open(target) as store:
        assert len(store) == count
        assert s3.count() == 2, s3.requests
        assert s3.bytes_sent() <= 2 * index_bytes
        assert np.all(store["layer_00042/bias"] == 42)


@pytest.mark.parametrize("suffix", FORMATS)
def test_one_scope_transfers_its_bytes_and_the_index(s3, suffix):
    target = url(suffix)
    ws.save(target, WEIGHTS)
    s3.reset()
    ws.open(target).close()
    index = s3.bytes_sent()
    s3.reset()
    loaded = ws.load(target, scope="block_1")
    selected = sum(a.nbytes for a in loaded.values())
    assert selected == 4 * 128 * 256 * 4
    assert same(loaded, {k[len("block_1/"):]: v for k, v in WEIGHTS.items() if k.startswith("block_1/")})
    assert s3.bytes_sent() <= 1.1 * selected + index, (s3.bytes_sent(), selected, index)
    assert s3.count() == 1 + 1  # the index, then one ranged GET for the scope's neighbouring tensors
    assert all(r.range for r in s3.requests), "every GET is ranged"


@pytest.mark.parametrize("suffix", FORMATS)
def test_full_load_is_exact_verified_and_concurrent(s3, suffix, monkeypatch):
    monkeypatch.setattr(objects, "PART_BYTES", 256 << 10)  # 2 MB in 8 parts
    target = url(suffix)
    ws.save(target, WEIGHTS)
    arrived = threading.Barrier(2, timeout=5)
    overlapped: list[bool] = []

    def wait_for_a_second_get(environ):
        """Hold the first GET until a second one arrives: only a concurrent reader gets past."""
        if environ["REQUEST_METHOD"] == "GET" and not overlapped:
            try:
                arrived.wait()
                overlapped.append(True)
            except threading.BrokenBarrierError:
                overlapped.append(False)  # a serial reader: the lone request goes on alone
        return None

    with ws.open(target) as store:
        assert store.verify and store.has_checksums
        s3.reset()
        s3.intercept = wait_for_a_second_get
        loaded = store.read()
    assert same(loaded, WEIGHTS)
    assert all(a.ctypes.data % 64 == 0 for a in loaded.values()), "aligned as in the file, for TF's DLPack"
    assert s3.most_in_flight >= 2 and any(overlapped)
    assert s3.bytes_sent() <= 1.1 * sum(a.nbytes for a in WEIGHTS.values())


def test_neighbours_come_in_one_request_each_into_memory_of_its_own(s3):
    """Tensors a few bytes apart are fetched by one request whose body is split between them as it
    arrives: each array owns its memory (a follower hands it to the framework to keep), none is a
    view into a block that holds its neighbours too."""
    small = {f"small/{i}": np.full(200, i, np.float32) for i in range(3)}  # 800 bytes each, side by side
    target = url(".npz")
    ws.save(target, {**small, "tail": np.zeros(1 << 18, np.float32)})  # 1 MB after them: past the index window
    with ws.open(target) as store:
        s3.reset()
        got = store.read(["small/0", "small/2"])
    assert s3.count("GET") == 1 and s3.bytes_sent() < 4096  # small/1, between them, fetched and dropped
    assert same(got, {key: small[key] for key in ("small/0", "small/2")})
    assert memory_owner(got["small/0"]) is not memory_owner(got["small/2"])


def test_a_large_tensor_is_fetched_in_concurrent_parts(s3, monkeypatch):
    monkeypatch.setattr(objects, "PART_BYTES", 1 << 20)
    big = {"big": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)}  # 4 MB: four parts
    target = url(".safetensors")
    ws.save(target, big)
    with ws.open(target) as store:
        s3.reset()
        assert np.array_equal(store["big"], big["big"])
    assert s3.count("GET") == 4 and s3.bytes_sent() <= 4 << 20


def test_save_uploads_parts_concurrently_and_appears_only_when_complete(s3, monkeypatch):
    monkeypatch.setattr(commit, "UPLOAD_PART_BYTES", 5 << 20)  # S3's smallest part
    weights = {"w": np.random.default_rng(0).standard_normal((3 << 20,)).astype(np.float32)}  # 12 MB
    target = url(".npz")
    seen_before_complete = []
    parts_at_once = []

    def look_before_complete(environ):
        if environ["REQUEST_METHOD"] == "POST" and "uploadId=" in environ.get("QUERY_STRING", ""):
            import s3fs

            parts_at_once.append(s3.most_in_flight)  # before this look adds a request of its own

            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            seen_before_complete.append(fs.exists(target[len("s3://"):]))
        return None

    s3.intercept = look_before_complete
    ws.save(target, weights)
    s3.intercept = None
    parts = [r for r in s3.requests if r.method == "PUT" and "partNumber=" in r.query]
    assert len(parts) == 3 and parts_at_once[0] >= 2
    assert seen_before_complete == [False]
    assert same(ws.load(target), weights)


@pytest.mark.parametrize("floats", [1 << 10, 3 << 20], ids=["one PUT", "multipart"])
def test_a_version_upload_never_replaces_another_writers_version_of_its_step(s3, monkeypatch, floats):
    """Another writer's version of the step appears while this publish writes its own (a trainer
    restarted on another node while this one was stopped): the upload is refused, on the single
    PUT and on the completion of a multipart upload alike, and the other's version stays."""
    from weightstore.sync import _stages as stages

    monkeypatch.setattr(commit, "UPLOAD_PART_BYTES", 5 << 20)  # S3's smallest part: 12 MB is 3
    folder = url("").rsplit("/", 1)[0]
    theirs = {"w": np.full(4, 7, np.float32)}
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)

    def the_other_writer_publishes(stage):
        if stage == "version-temporary":
            monkeypatch.setattr(stages, "hook", None)
            ws.publish(folder, theirs, step=2)

    monkeypatch.setattr(stages, "hook", the_other_writer_publishes)
    with pytest.raises(ws.PublishError, match="another writer wrote its own step-000000000002.npz"):
        ws.publish(folder, {"w": np.ones(floats, np.float32)}, step=2)
    assert ws.latest(folder).step == 2 and same(ws.load(ws.latest(folder)), theirs)
    multipart = [r for r in s3.requests if r.method == "POST" and "uploadId=" in r.query]  # its completions
    assert len(multipart) == (1 if floats > 1 << 10 else 0)  # the refused completion


@pytest.mark.parametrize("floats", [1 << 10, 3 << 20], ids=["one PUT", "multipart"])
def test_a_version_upload_whose_answer_was_lost_is_published_when_the_clients_retry_is_refused(s3, monkeypatch,
                                                                                               floats):
    """The version's upload lands, but its answer is lost (the connection reset): the client
    sends it again (s3fs retries a lost connection), and S3 refuses the retry, as an object has
    the name now, the one the first try landed. That is this publish's own version, published;
    it was refused as another writer's (and a BackgroundPublisher gave the step up for good)."""
    import socket
    import struct

    monkeypatch.setattr(commit, "UPLOAD_PART_BYTES", 5 << 20)  # S3's smallest part: 12 MB is 3
    folder = url("").rsplit("/", 1)[0]
    ws.publish(folder, {"w": np.zeros(4, np.float32)}, step=1)
    mine = {"w": np.arange(floats, dtype=np.float32)}
    tries: list[str] = []

    def landed_but_answer_lost(environ):
        completes = "uploadId=" in environ.get("QUERY_STRING", "") and environ["REQUEST_METHOD"] == "POST"
        uploads = completes or (environ["REQUEST_METHOD"] == "PUT" and "uploadId=" not in environ["QUERY_STRING"])
        if not uploads or "/step-000000000002" not in environ["PATH_INFO"]:
            return None
        tries.append(environ["REQUEST_METHOD"])
        if len(tries) > 1:  # the retry: refused, an object has the name (moto completes a done upload again)
            return None if not completes else (412, b"<Error><Code>PreconditionFailed</Code></Error>")
        list(s3._moto(environ, lambda *answer: None))  # landed ...
        connection = environ["werkzeug.socket"]  # ... and its answer lost: the connection reset
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.shutdown(socket.SHUT_RDWR)
        return 500, b""

    s3.intercept = landed_but_answer_lost
    version = ws.publish(folder, mine, step=2)
    s3.intercept = None
    assert len(tries) == 2 and version.step == 2 and ws.latest(folder).step == 2
    assert same(ws.load(ws.latest(folder)), mine)


REFUSALS = {"501 NotImplemented": (501, b"<Error><Code>NotImplemented</Code><Message>If-None-Match</Message></Error>"),
            "400 InvalidArgument": (400, b"<Error><Code>InvalidArgument</Code><Message>If-None-Match</Message></Error>"),
            "400 NotImplemented": (400, b"<Error><Code>NotImplemented</Code><Message>no</Message></Error>")}


def version_uploads(environ) -> str | None:
    """``"conditional"`` or ``"plain"`` for the request that makes a version file appear (its
    single PUT, or its multipart completion), else ``None``."""
    method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
    lands = (method == "POST" and "uploadId=" in query) or (method == "PUT" and "partNumber=" not in query)
    if not lands or "/step-" not in environ["PATH_INFO"]:
        return None
    return "conditional" if environ.get("HTTP_IF_NONE_MATCH") else "plain"


@pytest.mark.parametrize("refusal", list(REFUSALS))
@pytest.mark.parametrize("floats", [1 << 10, 3 << 20], ids=["one PUT", "multipart"])
def test_a_store_that_refuses_conditional_uploads_gets_plain_ones_with_one_warning(s3, monkeypatch, caplog, floats,
                                                                                    refusal):
    """Some S3-compatible stores answer If-None-Match on a PUT or a multipart completion with
    501 or 400 instead of ignoring it: every version failed there. The refused upload is sent
    once more without it, and so is every later one to that store, with one warning naming the
    store and the protection lost; the token still tells a publisher its own object."""
    monkeypatch.setattr(commit, "UPLOAD_PART_BYTES", 5 << 20)  # S3's smallest part: 12 MB is 3
    monkeypatch.setattr(commit, "_unconditional", set())
    folder = url("").rsplit("/", 1)[0]
    seen: list[str] = []

    def no_conditions(environ):
        kind = version_uploads(environ)
        if kind is not None:
            seen.append(kind)
        return REFUSALS[refusal] if kind == "conditional" else None

    s3.intercept = no_conditions
    with caplog.at_level(logging.WARNING, logger="weightstore"):
        for step in (1, 2, 3):
            ws.publish(folder, {"w": np.full(floats, step, np.float32)}, step=step)
    assert seen == ["conditional", "plain", "plain", "plain"], seen
    said = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(said) == 1 and s3.endpoint in said[0] and "If-None-Match" in said[0], said
    assert "can replace that version" in said[0]
    assert ws.latest(folder).step == 3 and np.all(ws.load(ws.latest(folder))["w"] == 3)


def test_an_upload_refused_again_without_its_condition_fails_once_never_for_ever(s3, monkeypatch, caplog):
    """A 400 InvalidArgument that is not about the condition (the plain upload gets it too) is
    raised after that one plain try, and the store keeps its conditional uploads."""
    monkeypatch.setattr(commit, "_unconditional", set())
    folder = url("").rsplit("/", 1)[0]
    seen: list[str] = []

    def refuses_every_version(environ):
        kind = version_uploads(environ)
        if kind is not None:
            seen.append(kind)
        return REFUSALS["400 InvalidArgument"] if kind is not None else None

    s3.intercept = refuses_every_version
    with pytest.raises(ws.StorageError) as caught:
        ws.publish(folder, {"w": np.ones(4, np.float32)}, step=1)
    assert seen == ["conditional", "plain"] and not caught.value.transient
    assert not commit._unconditional and "refuses uploads" not in caplog.text


def test_a_publish_that_lost_the_race_for_latest_says_so_even_where_its_tidying_fails(s3):
    """A publish whose compare-and-swap of LATEST is refused (another publisher committed first)
    raises PublishError, which no retry passes; the look at its own file that follows failing
    (an outage) does not turn it into a transient StorageError that a BackgroundPublisher retries."""
    folder = url("").rsplit("/", 1)[0]
    ws.publish(folder, {"w": np.ones(4, np.float32)}, step=1)
    lost: list[str] = []

    def lost_then_unavailable(environ):
        method, path = environ["REQUEST_METHOD"], environ["PATH_INFO"]
        if method == "PUT" and path.endswith("/LATEST") and environ.get("HTTP_IF_MATCH"):
            lost.append(path)
            return 412, b"<Error><Code>PreconditionFailed</Code><Message>no</Message></Error>"
        return (503, b"") if lost and method in ("HEAD", "GET") and "/step-000000000002" in path else None

    s3.intercept = lost_then_unavailable
    with pytest.raises(ws.PublishError, match="LATEST changed while step 2 was being published"):
        ws.publish(folder, {"w": np.full(4, 2, np.float32)}, step=2)
    assert lost and ws.latest(folder).step == 1


def test_a_refusal_of_a_multipart_uploads_part_leaves_the_uploads_conditional(s3, monkeypatch, caplog):
    """A 400 InvalidArgument to a part of a multipart upload (a request that carries no
    condition: a proxy's hiccup) is no refusal of If-None-Match: the publish fails as before,
    and the next version is still uploaded only where none has its name."""
    monkeypatch.setattr(commit, "UPLOAD_PART_BYTES", 5 << 20)
    monkeypatch.setattr(commit, "_unconditional", set())
    folder = url("").rsplit("/", 1)[0]
    seen: list[str] = []

    def one_bad_part(environ):
        if environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in environ.get("QUERY_STRING", "") and not seen:
            seen.append("part refused")
            return REFUSALS["400 InvalidArgument"]
        kind = version_uploads(environ)
        if kind is not None:
            seen.append(kind)
        return None

    s3.intercept = one_bad_part
    with pytest.raises(ws.StorageError):
        ws.publish(folder, {"w": np.ones(3 << 20, np.float32)}, step=1)
    ws.publish(folder, {"w": np.full(4, 2, np.float32)}, step=2)
    assert seen[0] == "part refused" and "plain" not in seen and seen[-1] == "conditional", seen
    assert not commit._unconditional and "refuses uploads" not in caplog.text
    assert ws.latest(folder).step == 2


def test_a_store_that_refuses_a_conditional_latest_says_so_and_is_not_waited_out(s3):
    """LATEST is replaced only by compare-and-swap: a store that answers If-None-Match or If-Match
    with 501 cannot hold a versioned folder, said at once, not retried as an outage."""
    folder = url("").rsplit("/", 1)[0]
    s3.intercept = lambda environ: REFUSALS["501 NotImplemented"] if environ["PATH_INFO"].endswith("/LATEST") and (
        environ.get("HTTP_IF_NONE_MATCH") or environ.get("HTTP_IF_MATCH")) else None
    with pytest.raises(ws.StorageError, match="refuses conditional writes .*replacing LATEST") as caught:
        ws.publish(folder, {"w": np.ones(4, np.float32)}, step=1)
    assert not caught.value.transient and caught.value.path == f"{folder}/LATEST"


# -- a hostile or failing store ----------------------------------------------------------------

@pytest.mark.parametrize("suffix", FORMATS)
def test_object_shorter_than_its_index_says(s3, suffix, tmp_path):
    local = tmp_path / f"w{suffix}"
    ws.save(local, WEIGHTS)
    data = local.read_bytes()
    target = url(suffix)
    # npz: drop data from the middle, so the directory points past the end; safetensors: cut the tail
    put(target, data[:100_000] + data[300_000:] if suffix == ".npz" else data[:-100_000])
    with pytest.raises(ws.FormatError, match=target.replace("/", ".")):
        ws.load(target)


@pytest.mark.parametrize("suffix", FORMATS)
def test_object_replaced_while_open(s3, suffix):
    target = url(suffix)
    ws.save(target, WEIGHTS)
    with ws.open(target) as store:
        ws.save(target, {k: v + 1 for k, v in WEIGHTS.items()})
        with pytest.raises(ws.FormatError, match="changed while it was open") as caught:
            store["block_2/w0"]  # outside the index window, so read after the change
    assert target in str(caught.value)


def answering_ranges(answer):
    """An intercept of the loopback server that answers each ranged GET with ``answer(first, last)``
    (the Range header's bounds; ``first`` None for a suffix read): ``(status, body)``, without a
    Content-Range, or ``(status, body, headers)``; None leaves the request to the server."""
    def intercept(environ):
        wanted = environ.get("HTTP_RANGE", "")
        if environ["REQUEST_METHOD"] != "GET" or not wanted.startswith("bytes="):
            return None
        first, last = wanted[len("bytes="):].split("-")
        return answer(int(first) if first else None, int(last))
    return intercept


@pytest.mark.parametrize("suffix", FORMATS)
@pytest.mark.parametrize("answer", ["whole object", "other range"])
def test_a_ranged_read_answered_with_other_bytes_is_refused_never_read_as_the_tensor(s3, suffix, answer):
    """A server (or a proxy before it) that ignores ``Range`` answers 200 with the whole object,
    one that misplaces it answers bytes from elsewhere: the second body has the length asked
    for, so only its ``Content-Range`` tells. Unverified, those bytes became the tensor."""
    target = url(suffix)
    ws.save(target, WEIGHTS)
    whole = get(target)

    with ws.open(target, verify=False) as store:
        s3.intercept = answering_ranges(lambda first, last: (200, whole) if answer == "whole object"
                                        else (206, whole[: last + 1 - first]))
        with pytest.raises(ws.StorageError, match="asked for bytes") as caught:
            store["block_2/w1"]  # outside the index window: a request of its own, not from byte 0
    assert caught.value.path == target


def test_object_removed_while_open(s3):
    import s3fs

    target = url(".npz")
    ws.save(target, WEIGHTS)
    with ws.open(target) as store:
        s3fs.S3FileSystem().rm_file(target[len("s3://"):])
        with pytest.raises(ws.StoreNotFoundError, match="removed while it was open"):
            store["block_2/w0"]  # outside the index window, so read after the change


@pytest.mark.parametrize("when", ["open", "read"])
def test_server_errors_are_storage_errors(s3, when):
    target = url(".npz")
    ws.save(target, WEIGHTS)
    failing = (500, b"<Error><Code>InternalError</Code><Message>down</Message></Error>")
    if when == "open":
        s3.intercept = lambda environ: failing
        with pytest.raises(ws.StorageError, match="InternalError|down") as caught:
            ws.open(target)
    else:
        with ws.open(target) as store:
            s3.intercept = lambda environ: failing
            with pytest.raises(ws.StorageError) as caught:
                store["block_2/w1"]
    assert caught.value.path == target


@pytest.mark.parametrize("kind", ["hdf5", "folder", "hf-index"])
def test_an_outage_while_opening_any_kind_of_url_is_a_storage_error(s3, kind):
    """HDF5 opens through an fsspec file object, a URL without a suffix may be a folder, a
    Hugging Face index asks whether its shards exist: each request is the storage's, and its
    failure a StorageError a follower waits out, never the client library's own exception."""
    target = {"hdf5": url(".h5"), "folder": url(""), "hf-index": url("") + "/model.safetensors.index.json"}[kind]
    if kind == "hdf5":
        ws.save(target, WEIGHTS)
    failing = (500, b"<Error><Code>InternalError</Code><Message>down</Message></Error>")
    s3.intercept = lambda environ: failing
    with pytest.raises(ws.StorageError) as caught:
        ws.open(target)
    assert caught.value.path == target


def test_missing_and_empty_objects(s3):
    with pytest.raises(ws.StoreNotFoundError, match="no such file"):
        ws.open(url(".npz"))
    for suffix in FORMATS + [".bin"]:
        target = url(suffix)
        put(target, b"")
        with pytest.raises(ws.FormatError, match="empty|shorter") as caught:
            ws.open(target)
        assert target in str(caught.value)


def test_unknown_suffix_is_sniffed_in_the_same_request(s3):
    target = url(".safetensors")
    ws.save(target, WEIGHTS)
    renamed = target[: -len(".safetensors")] + ".weights"
    put(renamed, get(target))
    s3.reset()
    with ws.open(renamed) as store:
        assert s3.count() == 1 and store.keys() == list(WEIGHTS)


@pytest.mark.parametrize("real, named", [(".safetensors", ".npz"), (".npz", ".safetensors"), (".npz", ".h5")])
def test_a_url_under_another_formats_suffix_says_so_as_a_local_file_does(s3, tmp_path, real, named):
    """A safetensors object uploaded as ``model.npz`` was "not an npz file (no zip directory;
    truncated or not a zip)" on S3, where the same file on disk says which format its first bytes
    are (docs/formats.md): the URL's refusal now reads them too, one request more, and says so."""
    ws.save(tmp_path / f"real{real}", WEIGHTS)
    target = url(named)
    put(target, (tmp_path / f"real{real}").read_bytes())
    with ws.open(tmp_path / f"real{real}") as local:
        fmt = local.format
    with pytest.raises(ws.FormatError) as caught:
        ws.open(target)
    assert str(caught.value) == (f"{target}: its name says {'hdf5' if named == '.h5' else named[1:]}, but its first "
                                 f"bytes say {fmt}: rename it to end in {real} (or read it with ws.open(path, "
                                 f"format={fmt!r}))")
    with ws.open(target, format=fmt) as store:
        assert store.keys() == list(WEIGHTS)


def test_a_model_folder_on_s3_is_found_and_read_as_a_local_one(s3, tmp_path):
    """The folder format's ``find`` asks S3 what a local folder is asked (a folder? which files?),
    and only once no file answers the name: its shards are then read with ranged GETs."""
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}/model"
    ws.save(folder, WEIGHTS, max_shard_size=512 << 10)
    local = tmp_path / "model"
    ws.save(local, WEIGHTS, max_shard_size=512 << 10)
    for where in (folder, local):
        with ws.open(where) as store:
            assert store.format == "hf-sharded" and store.path == f"{where}/model.safetensors.index.json"
            assert store.keys() == list(WEIGHTS)
        assert same(ws.load(where), WEIGHTS)
    s3.reset()
    with pytest.raises(ws.StoreNotFoundError, match="no such file"):
        ws.open(f"{folder}/absent.npz")  # a name a format's suffix claims: no folder is looked for
    assert s3.count() == 1, s3.requests


def test_version_opens_in_two_requests(s3):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    ws.publish(folder, WEIGHTS, step=1)
    version = ws.latest(folder)
    s3.reset()
    with ws.open(version) as store:
        assert s3.count() <= 2, s3.requests
        assert np.array_equal(store["block_3/w3"], WEIGHTS["block_3/w3"])


def test_other_file_systems_catch_a_shortened_file(tmp_path):
    """Without ETags (here fsspec's memory file system) a replaced, shorter file is still caught."""
    import fsspec

    target = f"memory://transfer-{tmp_path.name}/w.npz"
    ws.save(target, WEIGHTS)
    with ws.open(target) as store:
        fsspec.filesystem("memory").pipe_file(target[len("memory://"):], b"x" * 600_000)
        with pytest.raises(ws.FormatError, match="shorter than when it was opened") as caught:
            store["block_3/w0"]
    assert target in str(caught.value)
    fsspec.filesystem("memory").rm(f"/transfer-{tmp_path.name}", recursive=True)


def test_concurrency_is_s3fs_max_concurrency(s3, monkeypatch):
    monkeypatch.setattr(objects, "PART_BYTES", 256 << 10)
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    ws.publish(folder, WEIGHTS, step=1)
    version = ws.latest(folder, storage_options={"max_concurrency": 1})
    s3.reset()
    assert same(ws.load(version), WEIGHTS)
    assert s3.most_in_flight == 1 and s3.count("GET") > 2


def test_a_remote_hdf5_file_warns_that_it_moves_more_than_it_reads(s3, tmp_path):
    import warnings

    from weightstore.formats.hdf5 import RemoteHDF5Warning

    target = url(".h5")
    ws.save(target, {"block_0/w0": WEIGHTS["block_0/w0"]})
    with pytest.warns(RemoteHDF5Warning, match="npz or safetensors") as caught, ws.open(target) as store:
        assert same({"w": store["block_0/w0"]}, {"w": WEIGHTS["block_0/w0"]})
    assert target in str(caught[0].message)
    ws.save(tmp_path / "local.h5", {"w": WEIGHTS["block_0/w0"]})
    second = target.rsplit("/", 1)[0] + "/second.h5"  # the same folder: a follower's next version
    ws.save(second, {"block_0/w0": WEIGHTS["block_0/w0"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RemoteHDF5Warning)  # once a folder, and never for a local HDF5 file
        ws.load(second)
        ws.load(tmp_path / "local.h5")
        remote_npz = url(".npz")
        ws.save(remote_npz, {"w": WEIGHTS["block_0/w0"]})
        ws.load(remote_npz)


def test_a_sharded_folder_on_s3_opens_by_its_folder_url(s3):
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}/model"
    ws.save(folder, WEIGHTS, max_shard_size=1 << 20)
    with ws.open(folder) as store:
        assert sorted(store.keys()) == sorted(WEIGHTS)
        assert np.array_equal(store["block_2/w1"], WEIGHTS["block_2/w1"])
    with pytest.raises(ws.StoreNotFoundError, match="no such file"):
        ws.open(f"s3://{BUCKET}/{uuid.uuid4().hex}/nothing")


# -- a folder of versions given where a file was expected ----------------------------------------

def test_ls_of_a_folder_of_versions_on_s3_names_latest_version_as_locally(s3, tmp_path):
    """Locally, ``ws ls run`` says the folder holds ws.publish versions and names LATEST's; on S3 it
    said the folder held no model.safetensors, as if it were a Hugging Face folder."""
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    small = {"w": np.arange(4, dtype=np.float32)}
    remote, local = f"s3://{BUCKET}/{uuid.uuid4().hex}/run", str(tmp_path / "run")
    for folder in (remote, local):
        for step in (1, 2):
            ws.publish(folder, small, step=step)
    outputs = {}
    for folder in (remote, local):
        latest = ws.latest(folder).path
        result = CliRunner().invoke(app, ["ls", folder])
        assert result.exit_code == 1, result.output
        outputs[folder] = " ".join(result.output.split())
        assert f"{folder}: is a folder of ws.publish versions, not one weight file; name a version, such as " \
               f"LATEST's {latest} (ws versions {folder} lists them" in outputs[folder], outputs[folder]
        with pytest.raises(ws.StoreNotFoundError, match="folder of ws.publish versions") as caught:
            ws.load(folder)
        assert caught.value.path == folder and not isinstance(caught.value, ws.VersionGoneError)
    assert outputs[remote].replace(remote, "FOLDER") == outputs[local].replace(local, "FOLDER")
    for folder in (remote, local):  # LATEST's version removed: a step-* file is suggested, not that one
        fs, path = fsspec.core.url_to_fs(ws.latest(folder).path)
        fs.rm_file(path)
        result = CliRunner().invoke(app, ["ls", folder])
        outputs[folder] = " ".join(result.output.split())
        assert "name a version, one of its step-* files" in outputs[folder] and "such as" not in outputs[folder]
    assert outputs[remote].replace(remote, "FOLDER") == outputs[local].replace(local, "FOLDER")
    put(f"{remote}/LATEST", b"garbage")  # a damaged LATEST: still a folder of versions
    with pytest.raises(ws.StoreNotFoundError, match="name a version, one of its step-\\* files"):
        ws.load(remote)
    empty = f"s3://{BUCKET}/{uuid.uuid4().hex}/model"
    put(f"{empty}/notes.txt", b"no weights")
    with pytest.raises(ws.StoreNotFoundError, match="is a folder that no format reads"):  # no LATEST: as before
        ws.load(empty)


def test_a_bucket_given_as_a_file_is_a_folder_as_any_other(s3, tmp_path):
    """``ws ls s3://bucket/`` was "storage failed (ParamValidationError: ... Invalid length for
    parameter Key ...)": boto's words, under the error that says "retry later". A bucket is
    refused as a folder that no format reads, as ``s3://bucket/folder/`` is, exit 1 naming it."""
    put(f"s3://{BUCKET}/{uuid.uuid4().hex}/m.npz", b"")
    out = str(tmp_path / "o.npz")
    for command in (["ls", f"s3://{BUCKET}"], ["ls", f"s3://{BUCKET}/"], ["export", f"s3://{BUCKET}/", "-o", out]):
        done = subprocess.run([sys.executable, "-m", "weightstore", *command], capture_output=True, text=True,
                              timeout=120)
        assert (done.returncode, done.stderr) == (1, f"error: {command[1]}: is a folder that no format reads\n")
    with pytest.raises(ws.StoreNotFoundError, match="is a folder that no format reads"):
        ws.load(f"s3://{BUCKET}/")
    assert not (tmp_path / "o.npz").exists()


def test_requests_of_an_open_and_a_one_scope_load_are_the_figures_the_docs_give(s3):
    """docs/object-storage.md: opening costs 1 request (the last or first 96 KB); loading one
    8 MB scope of a 64 MB file 3 (npz: the index, then the scope in two parts of at most 8 MB)
    or 2 (safetensors: its scope lies in one part), 8.1 MiB in all."""
    weights = {f"scope_{s}/w{t}": np.full((256, 1024), 8 * s + t, np.float32) for s in range(8) for t in range(8)}
    for suffix, load_requests in ((".npz", 3), (".safetensors", 2)):
        target = url(suffix)
        ws.save(target, weights)
        s3.reset()
        with ws.open(target):
            assert s3.count() == 1, s3.requests
        s3.reset()
        loaded = ws.load(target, scope="scope_3")
        assert sorted(loaded) == [f"w{t}" for t in range(8)] and np.all(loaded["w5"] == 29)
        assert s3.count() == load_requests, (suffix, s3.requests)
        assert 8 << 20 < s3.bytes_sent() < (8 << 20) + remote.INDEX_WINDOW + (4 << 10), s3.bytes_sent()


def test_a_safetensors_file_whose_header_length_starts_like_a_pickle_reads_from_s3(s3, tmp_path):
    """A header of 640 bytes begins ``80 02``, pickle's magic: read as the safetensors file it is,
    named so or sniffed, from object storage as locally."""
    import struct

    import safetensors.numpy

    path = tmp_path / "m.safetensors"
    weights = {"w": np.arange(6, dtype=np.float32)}
    for pad in range(700):
        safetensors.numpy.save_file(weights, str(path), metadata={"pad": "x" * pad})
        if struct.unpack("<Q", path.read_bytes()[:8])[0] == 640:
            break
    assert path.read_bytes()[:2] == b"\x80\x02"
    for suffix in (".safetensors", ".weights"):
        target = url(suffix)
        put(target, path.read_bytes())
        assert np.array_equal(ws.load(target)["w"], weights["w"])


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_an_opening_part_that_does_not_say_where_it_lies_is_refused(s3, suffix):
    """A proxy that strips Content-Range from a 206: the open's first request (an npz's last
    bytes, a safetensors header's first) must not take a part for the whole object."""
    target = url(suffix)
    ws.save(target, WEIGHTS)
    whole = get(target)

    s3.intercept = answering_ranges(lambda first, last: (206, whole[-last:] if first is None else whole[first : last + 1]))
    with pytest.raises(ws.StorageError, match="where its bytes lie") as caught:
        ws.load(target)
    assert caught.value.path == target
    s3.intercept = lambda environ: (200, whole) if environ["REQUEST_METHOD"] == "GET" else None
    loaded = ws.load(target)  # a service that ignores Range and says so (200): the whole object, read right
    assert all(loaded[key].tobytes() == value.tobytes() for key, value in WEIGHTS.items())


_RANGE_FIELD = st.one_of(st.integers(0, 3 << 20), st.sampled_from([0, 1, 2, 1023, 1024, 98303, 98304]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_a_ranged_answer_with_any_status_and_content_range_is_read_right_or_refused(server, data):
    """One ranged GET (the open's first, ``first()``, or a later one for tensors) answered 200 or
    206 with the bytes asked, the whole object, a shifted or short part, and any Content-Range
    (none, right, wrong, ``*``, garbage): what loads is exactly what was saved, or a
    WeightStoreError names the object."""
    suffix = data.draw(st.sampled_from(FORMATS), label="suffix")
    small = data.draw(st.booleans(), label="small")  # under the index window: a suffix read gets it all
    weights = {"w": np.arange(300, dtype=np.float32)} if small else WEIGHTS
    target = url(suffix)
    ws.save(target, weights)
    whole = get(target)
    which = data.draw(st.integers(0, 2), label="which ranged GET")
    status = data.draw(st.sampled_from([200, 206]), label="status")
    body_kind = data.draw(st.sampled_from(["asked", "whole", "shifted", "short"]), label="body")
    shift = data.draw(st.integers(1, 64), label="shift")
    header = data.draw(st.one_of(
        st.none(), st.just("right"), st.just("right*"),
        st.tuples(_RANGE_FIELD, _RANGE_FIELD, st.one_of(_RANGE_FIELD, st.just("*"))).map(
            lambda t: f"bytes {t[0]}-{t[1]}/{t[2]}"),
        st.sampled_from([f"bytes */{len(whole)}", "bytes 0-/1", "bytes=0-1/2", "bytes -1-2/3", "items 0-1/2", ""])),
        label="content-range")
    answered = []

    def mangled(first, last):
        answered.append((first, last))
        if len(answered) != which + 1:
            return None  # moto answers it
        start = max(len(whole) - last, 0) if first is None else first
        end = len(whole) if first is None else min(last + 1, len(whole))
        body = {"asked": whole[start:end], "whole": whole, "shifted": whole[max(start - shift, 0):end - shift],
                "short": whole[start:end - shift]}[body_kind]
        if header is None:
            return status, body
        said = {"right": f"bytes {start}-{end - 1}/{len(whole)}", "right*": f"bytes {start}-{end - 1}/*"}
        return status, body, {"Content-Range": said.get(header, header)}

    server.intercept = answering_ranges(mangled)
    try:
        loaded = ws.load(target)
    except ws.WeightStoreError as exc:
        assert exc.path == target, exc
        event(f"refused: {type(exc).__name__}")
        return
    finally:
        server.intercept = None
    assert same(loaded, weights), (answered, status, body_kind, header)
    event("read" if len(answered) > which else "read, fewer GETs")
