"""What docs/design.md's "Adding a format, an adapter or a backend" says, done once each.

A toy format is registered through the one table and round-trips through ``ws.save`` and
``ws.open`` (locally and on a URL); a toy folder format (one module, registered in the same
table) is found and read in a local folder and on a URL alike; a toy backend (one module,
registered in the table of backends) serves every byte a remote open reads and the
compare-and-swap a publish needs; a toy framework's adapter, one module and one
``adapters.register`` line, gets planning and hot reload from the skeleton and is followed by a
``Follower``. If the steps the document gives stop being enough, these fail.
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
import threading
import uuid

import numpy as np
import pytest

import weightstore as ws
from weightstore import adapters, formats
from weightstore.adapters import _registry
from weightstore.io import backends
from weightstore.sync import _stages as stages

TOY_FORMAT = textwrap.dedent('''
    """A toy format: magic, the tensors' bytes one after another, the manifest, its length."""

    import struct

    import numpy as np

    from weightstore.errors import ChecksumError, FormatError, KeyNotInStoreError
    from weightstore.formats import Format, ReaderDefaults
    from weightstore.io.source import open_source
    from weightstore.core.manifest import checksum, crc32, from_storage, parse_manifest, storage_dtype

    MAGIC = b"TOYWS\\0\\0\\0"


    class ToyWriter:
        def __init__(self, path, compress):
            self._file = open(path, "wb")
            self._file.write(MAGIC)
            self.locations, self.codecs = {}, {}

        def add(self, key, dtype_name, data):
            self._file.write(memoryview(data).cast("B") if data.nbytes else b"")
            return crc32(data)

        def commit(self, manifest_text):
            raw = manifest_text.encode("utf-8")
            self._file.write(raw + struct.pack("<Q", len(raw)))
            self._file.close()

        def abort(self):
            self._file.close()


    class ToyReader(ReaderDefaults):
        def __init__(self, source):
            self._source, self.name = source, source.name
            (length,) = struct.unpack("<Q", bytes(source.read_at(source.size - 8, 8)))
            if length > source.size - 16:
                raise FormatError("manifest length runs past the file", path=self.name)
            manifest = parse_manifest(bytes(source.read_at(source.size - 8 - length, length)).decode(), self.name)
            self.metadata, self.created, self.has_checksums = manifest.metadata, manifest.created, True
            self._infos, self._offsets, offset = manifest.tensors, {}, len(MAGIC)
            for key, info in self._infos.items():
                self._offsets[key], offset = offset, offset + info.nbytes
            if offset != source.size - 8 - length:
                raise FormatError("tensors do not fill the file", path=self.name)

        def keys(self):
            return list(self._infos)

        def info(self, key):
            if key not in self._infos:
                raise KeyNotInStoreError("no such tensor", path=self.name, key=key)
            return self._infos[key]

        def read(self, key, *, verify):
            info = self.info(key)
            self._source.check_unchanged(f"tensor {key!r}")
            data = self._source.read_at(self._offsets[key], info.nbytes)
            if verify and checksum(data) != info.checksum:
                raise ChecksumError("checksum mismatch", path=self.name, key=key)
            array = np.frombuffer(data, storage_dtype(info.dtype)).reshape(info.shape)
            return from_storage(array, info.dtype)

        def close(self):
            self._source.close()


    FORMAT = Format(
        name="toy",
        suffixes=(".toy",),
        magic=lambda head: head.startswith(MAGIC),
        open_reader=lambda location, name, *, mmap=True: open_source(location, name, ToyReader, index_at_end=True, mmap=mmap),
        open_writer=ToyWriter,
        compresses=False,
    )
''')

WEIGHTS = {"dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "dense/bias": np.ones(4, np.int64),
           "empty": np.zeros((0, 3), np.float16)}


@pytest.fixture
def toy_format(tmp_path, monkeypatch):
    module = f"toy_format_{uuid.uuid4().hex}"
    (tmp_path / f"{module}.py").write_text(TOY_FORMAT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(formats, "FORMAT_MODULES", list(formats.FORMAT_MODULES))
    formats.register(module)
    yield module
    sys.modules.pop(module, None)


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_a_registered_format_round_trips_through_save_and_open(tmp_path, toy_format):
    path = tmp_path / "model.toy"
    ws.save(path, WEIGHTS, metadata={"step": 3})
    assert path.read_bytes().startswith(b"TOYWS")
    with ws.open(path) as store:
        assert store.keys() == list(WEIGHTS) and store.metadata == {"step": 3}
        assert all(same(store[key], value) for key, value in WEIGHTS.items())
        assert all(same(a, b) for a, b in zip(store.read().values(), WEIGHTS.values(), strict=True))  # read_many's default
    renamed = tmp_path / "model.bin"
    path.rename(renamed)
    with ws.open(renamed, format="toy") as store:
        assert same(store["dense/kernel"], WEIGHTS["dense/kernel"])
    assert same(ws.load(renamed)["dense/bias"], WEIGHTS["dense/bias"])  # found by its magic bytes


def test_threads_saving_at_once_wait_for_a_format_module_another_thread_is_importing(tmp_path, monkeypatch):
    """The first saves of a process, from several threads at once (a rank per thread): each
    waits for the format's import another thread began, none finds the module half made."""
    module = f"toy_format_{uuid.uuid4().hex}"
    (tmp_path / f"{module}.py").write_text("import time\ntime.sleep(0.5)  # h5py's import, say\n" + TOY_FORMAT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(formats, "FORMAT_MODULES", list(formats.FORMAT_MODULES))
    formats.register(module)
    failures: list[BaseException] = []

    def save(number: int) -> None:
        try:
            ws.save(tmp_path / f"model-{number}.toy", WEIGHTS)
        except BaseException as error:  # noqa: BLE001 - whatever a thread met is the finding
            failures.append(error)

    try:
        threads = [threading.Thread(target=save, args=(number,)) for number in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.modules.pop(module, None)
    assert failures == []
    assert all((tmp_path / f"model-{number}.toy").read_bytes().startswith(b"TOYWS") for number in range(4))


def test_a_registered_format_reads_on_a_url_and_refuses_damage(tmp_path, toy_format):
    url = f"memory://toy-{tmp_path.name}/model.toy"
    ws.save(url, WEIGHTS)
    assert same(ws.load(url)["dense/kernel"], WEIGHTS["dense/kernel"])
    path = tmp_path / "model.toy"
    ws.save(path, WEIGHTS)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    with ws.open(path) as store, pytest.raises(ws.ChecksumError) as caught:
        store["dense/kernel"]
    assert (caught.value.path, caught.value.key) == (str(path), "dense/kernel")


TOY_FOLDER_FORMAT = textwrap.dedent('''
    """A toy folder format: a folder of ``.npy`` files, one per tensor, and ``tensors.json``
    mapping each key to its file. Recognised by where it lies (``find``), local or remote alike."""

    import io
    import json

    import numpy as np

    from weightstore.core.manifest import TensorInfo
    from weightstore.errors import KeyNotInStoreError, UnsafeFileError
    from weightstore.formats import Format, ReaderDefaults, foreign_keys
    from weightstore.io.source import beside, byte_source, read_whole

    LISTING = "tensors.json"


    def plain(file):
        """A ``.npy`` file beside the listing: no folder, no way out of it."""
        return (isinstance(file, str) and file.endswith(".npy") and not file.startswith(".")
                and not any(mark in file for mark in ("/", "\\\\", "\\0")))


    def find(place):
        """The folder's listing, if it holds one; asked of a local folder and a URL alike."""
        if place.is_dir() and LISTING in place.names():
            return place.child(LISTING)
        return None


    class NpyFolderReader(ReaderDefaults):
        def __init__(self, location, name, mmap=True):
            self.name, self._location = name, location
            listing = json.loads(read_whole(byte_source(location, name, mmap=mmap), 1 << 20, "tensor listing"))
            for file in listing.values():
                if not plain(file):
                    raise UnsafeFileError(f"names {file!r}, which is not a .npy file beside it", path=name)
            self._file_of = foreign_keys(listing.items(), "tensor")
            self.metadata, self.created, self.has_checksums = {}, "", False

        def keys(self):
            return list(self._file_of)

        def info(self, key):
            array = self.read(key, verify=False)  # a toy: the header is the whole file
            return TensorInfo(key, array.dtype.name, array.shape, array.nbytes)

        def read(self, key, *, verify):
            if key not in self._file_of:
                raise KeyNotInStoreError("no such tensor", path=self.name, key=key)
            location, name = beside(self._location, self.name, self._file_of[key])
            data = read_whole(byte_source(location, name), 1 << 30, "tensor file")
            return np.load(io.BytesIO(data), allow_pickle=False)

        def close(self):
            pass


    def refuse_writing(path, compress):
        raise ValueError("the toy folder format is only read")


    FORMAT = Format(name="npy-folder", suffixes=(), magic=lambda head: False, open_reader=NpyFolderReader,
                    open_writer=refuse_writing, writes=False, find=find)
''')


@pytest.fixture
def toy_folder_format(tmp_path, monkeypatch):
    module = f"toy_folder_format_{uuid.uuid4().hex}"
    (tmp_path / f"{module}.py").write_text(TOY_FOLDER_FORMAT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(formats, "FORMAT_MODULES", list(formats.FORMAT_MODULES))
    formats.register(module)
    yield module
    sys.modules.pop(module, None)


def test_a_registered_folder_format_reads_a_local_folder_and_a_url_through_one_entry(tmp_path, toy_folder_format):
    import fsspec

    folder = tmp_path / "npy-model"
    folder.mkdir()
    listing = {key: key.replace("/", "-") + ".npy" for key in WEIGHTS}
    for key, file in listing.items():
        np.save(folder / file, WEIGHTS[key])
    (folder / "tensors.json").write_text(json.dumps(listing))
    url = f"memory://folder-format-{tmp_path.name}/npy-model"
    memory = fsspec.filesystem("memory")
    for entry in folder.iterdir():
        memory.pipe_file(f"{url[len('memory://'):]}/{entry.name}", entry.read_bytes())
    for where in (folder, url):
        with ws.open(where) as store:
            assert store.format == "npy-folder" and store.path == f"{where}/tensors.json"
            assert store.keys() == list(WEIGHTS)
            assert all(same(store[key], value) for key, value in WEIGHTS.items())
        assert same(ws.load(where, scope="dense")["kernel"], WEIGHTS["dense/kernel"])
    (folder / "tensors.json").write_text(json.dumps({"w": "../elsewhere.npy"}))
    with pytest.raises(ws.UnsafeFileError, match="not a .npy file beside it"):
        ws.open(folder)


TOY_BACKEND = textwrap.dedent('''
    """A toy backend for memory://: ranged reads by one ``cat_file`` each, and compare-and-swap.

    fsspec's memory file system lives in this process, so one lock around "look, then write"
    makes a conditional write atomic for every writer there is; a tag is the content's digest.
    """

    import hashlib
    import threading

    from weightstore.io.objects import Backend

    SERVED = []  # (offset, length) of every ranged read, for the test to see


    class CatFileObject:
        def __init__(self, fs, path, name):
            self._fs, self._path, self.name = fs, path, name

        def first(self, index_at_end, window, size, details):
            size = int(self._fs.info(self._path)["size"]) if size is None else size
            start = max(0, size - window) if index_at_end else 0
            data = memoryview(bytearray(min(size, window)))
            self.fill([(start, data)], opening=True)
            return size, start, data

        def fill(self, ranges, opening=False):
            for at, view in ranges:
                view[:] = self._fs.cat_file(self._path, at, at + len(view))
                SERVED.append((at, len(view)))


    class MemoryBackend(Backend):
        def __init__(self):
            self._lock = threading.Lock()

        def serves(self, fs):
            return "memory" in fs.protocol

        def object(self, fs, path, name):
            return CatFileObject(fs, path, name)

        def read_tagged(self, fs, path, limit):
            with self._lock:
                data = fs.cat_file(path) if fs.exists(path) else None
            return (None, None) if data is None else (data[:limit], hashlib.sha256(data).hexdigest())

        def put_if(self, fs, path, data, *, create, expect):
            with self._lock:
                current = fs.cat_file(path) if fs.exists(path) else None
                if create and current is not None:
                    return False
                if expect is not None and (current is None or hashlib.sha256(current).hexdigest() != expect):
                    return False
                fs.pipe_file(path, data)
            return True


    BACKEND = MemoryBackend()
''')


@pytest.fixture
def toy_backend(tmp_path, monkeypatch):
    module = f"toy_backend_{uuid.uuid4().hex}"
    (tmp_path / f"{module}.py").write_text(TOY_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(backends, "BACKEND_MODULES", list(backends.BACKEND_MODULES))
    backends.register(module)
    yield importlib.import_module(module)
    sys.modules.pop(module, None)


def test_a_registered_backend_serves_every_remote_read(tmp_path, toy_backend):
    url = f"memory://backend-{tmp_path.name}/model.npz"
    ws.save(url, WEIGHTS)
    with ws.open(url) as store:
        assert all(same(store[key], value) for key, value in WEIGHTS.items())
    assert toy_backend.SERVED, "the toy backend read the file"


def test_a_registered_backend_with_conditional_writes_lets_one_of_two_publishers_win(tmp_path, toy_backend,
                                                                                     monkeypatch):
    """Without the toy, memory:// has no compare-and-swap and a publish there is refused
    (tests/test_versions.py); with it, publishing needs no promise of one writer, and of two
    publishers that read the same LATEST exactly one moves it."""

    folder = f"memory://backend-{tmp_path.name}/run"
    ws.publish(folder, WEIGHTS, step=1)
    both_read, first_done = threading.Barrier(2, timeout=30), threading.Event()

    def stage(name):
        if name == "cleaned":
            both_read.wait()  # both have read LATEST, step 1
        if name == "version-written" and threading.current_thread().name == "second":
            first_done.wait(30)  # the first swaps LATEST while the second's version is written

    monkeypatch.setattr(stages, "hook", stage)
    outcomes = {}

    def publish(step):
        try:
            outcomes[step] = ws.publish(folder, WEIGHTS, step=step).step
        except ws.PublishError as exc:
            outcomes[step] = exc
        finally:
            if threading.current_thread().name == "first":
                first_done.set()

    threads = [threading.Thread(target=publish, args=(2,), name="first"),
               threading.Thread(target=publish, args=(3,), name="second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    monkeypatch.setattr(stages, "hook", lambda name: None)
    assert outcomes[2] == 2
    assert isinstance(outcomes[3], ws.PublishError) and "LATEST changed" in str(outcomes[3])
    assert ws.latest(folder).step == 2
    assert same(ws.load(ws.latest(folder))["dense/kernel"], WEIGHTS["dense/kernel"])
    assert toy_backend.SERVED  # the version was read through the toy too
    assert ws.publish(folder, WEIGHTS, step=3).step == 3


TOY_FRAMEWORK = textwrap.dedent('''
    """A toy framework: a model's variables are numpy arrays in a dict."""

    import numpy as np


    class Model:
        def __init__(self):
            self.variables = {"dense/kernel": np.zeros((3, 4), np.float32), "dense/bias": np.zeros(4, np.int64)}
''')

TOY_ADAPTER = textwrap.dedent('''
    """The toy framework's adapter: list the targets, write the arrays, and nothing else."""

    import numpy as np

    from weightstore.adapters.plan import AssignOptions, Selection

    from weightstore.adapters._report import TargetInfo
    from weightstore.adapters.skeleton import Target, run_assign


    def variables(model, **selection):
        return {key: model.variables[old] for key, old in Selection(**selection).choose(
            model.variables, lambda key: True).items()}


    def assign(model, weights, *, layout=None, **words):
        model.layout = layout  # the toy's own layouts: whatever name it is given
        targets = {key: TargetInfo(key, value.dtype, value.shape) for key, value in model.variables.items()}

        def write(batch, report):
            for key, array in batch:
                np.copyto(model.variables[key], array)
            return [key for key, _ in batch]

        return run_assign(Target(targets, write, slot=lambda key: (model, key)), weights, AssignOptions(**words))
''')


@pytest.fixture
def toy_adapter(tmp_path, monkeypatch):
    """The toy framework and its adapter, registered (one line) for the framework's objects."""
    framework, adapter = f"toy_framework_{uuid.uuid4().hex}", f"toy_adapter_{uuid.uuid4().hex}"
    (tmp_path / f"{framework}.py").write_text(TOY_FRAMEWORK)
    (tmp_path / f"{adapter}.py").write_text(TOY_ADAPTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_registry, "ADAPTERS", dict(_registry.ADAPTERS))
    adapters.register(framework, adapter)
    yield importlib.import_module(framework), importlib.import_module(adapter)
    sys.modules.pop(framework, None)
    sys.modules.pop(adapter, None)


def test_a_toy_adapter_gets_planning_strictness_and_hot_reload_from_the_skeleton(tmp_path, toy_adapter):
    framework, toy = toy_adapter
    model = framework.Model()
    ws.publish(tmp_path, {"dense/kernel": np.ones((3, 4), np.float32), "dense/bias": np.arange(4)}, step=1)
    report = toy.assign(model, ws.latest(tmp_path))
    assert sorted(report.assigned) == ["dense/bias", "dense/kernel"]
    assert same(model.variables["dense/bias"], np.arange(4))
    assert toy.assign(model, ws.latest(tmp_path)).skipped  # the same version again: nothing to write
    with pytest.raises(ws.AssignmentError, match="no value for variable 'dense/bias'"):
        toy.assign(model, {"dense/kernel": np.full((3, 4), 7, np.float32)})
    assert same(model.variables["dense/kernel"], np.ones((3, 4), np.float32))  # a strict failure changes nothing


def test_a_registered_adapter_is_found_for_its_framework_and_followed(tmp_path, toy_adapter):
    from weightstore.adapters.serving.follower import Follower

    framework, toy = toy_adapter
    model = framework.Model()
    assert adapters.adapter_for(model) is toy
    assert adapters.adapter_for([model]) is toy  # a container: its first leaf's framework
    with Follower(model, tmp_path / "run", poll=0.005, exclude="dense/bias") as follower:
        for step in (1, 2):
            ws.publish(tmp_path / "run", {"dense/kernel": np.full((3, 4), step, np.float32)}, step=step)
            assert follower.wait(step, timeout=30).step == step, follower.error
            with follower.reading():
                assert same(model.variables["dense/kernel"], np.full((3, 4), step, np.float32))
    assert follower.report.assigned == ["dense/kernel"]


def test_a_registered_adapters_layouts_are_its_own_words_a_follower_passes_on(tmp_path, toy_adapter):
    from weightstore.adapters.serving.follower import Follower

    framework, _ = toy_adapter
    model = framework.Model()
    ws.publish(tmp_path / "run", {"dense/kernel": np.ones((3, 4), np.float32)}, step=1)
    with Follower(model, tmp_path / "run", poll=0.005, exclude="dense/bias", layout="toy-own") as follower:
        assert follower.wait(1, timeout=30).step == 1, follower.error
    assert model.layout == "toy-own"  # not refused as none of the package's layouts


class NoFramework:
    """An object of this test module's own: no framework's."""


def test_an_object_of_no_registered_framework_is_refused_naming_its_type(tmp_path):
    from weightstore.adapters.serving.follower import Follower

    with pytest.raises(ws.UnsupportedTargetError, match=r"no adapter takes an object of type "
                                                         r"test_extending\.NoFramework.*adapters\.register"):
        adapters.adapter_for(NoFramework())
    with pytest.raises(ws.UnsupportedTargetError, match=r"type dict \(holding numpy\.ndarray\)"):
        Follower(WEIGHTS, tmp_path)  # weights are no model
    with pytest.raises(ws.UnsupportedTargetError, match="an empty list holds no variables"):
        adapters.adapter_for([])


def test_hot_reload_writes_a_variable_under_two_keys_unless_both_are_unchanged(tmp_path):
    """Two keys of one variable (tied weights) share its memory: skipping the one whose bytes
    match what the variable last received, while writing the other, left the variable holding
    a value a plain assign of the same file never gives, and flipped it every version."""
    from weightstore.adapters._report import TargetInfo
    from weightstore.adapters.plan import AssignOptions
    from weightstore.adapters.skeleton import Target, run_assign

    shared = np.zeros(2, np.float32)
    variables = {"embed": shared, "head": shared}

    def write(batch, report):
        for key, array in batch:
            np.copyto(variables[key], array)
        return [key for key, _ in batch]

    def assign(weights):
        targets = {key: TargetInfo(key, value.dtype, value.shape) for key, value in variables.items()}
        return run_assign(Target(targets, write, slot=lambda key: (variables[key], "")), weights, AssignOptions())

    tied = {"embed": np.full(2, 1, np.float32), "head": np.full(2, 2, np.float32)}
    assert same(shared, np.zeros(2, np.float32))
    for step in (1, 2, 3):
        report = assign(ws.publish(tmp_path, tied, step=step))
        assert shared.tolist() == [2, 2], (step, report)  # as a plain assign of the file leaves it
        assert sorted(report.assigned) == ["embed", "head"] or sorted(report.skipped) == ["embed", "head"]
    assign(tied)  # a plain dict: always written
    assert shared.tolist() == [2, 2]
