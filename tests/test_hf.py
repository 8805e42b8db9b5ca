"""Hugging Face sharded folders: read as one lazy store, written as transformers and safetensors load them."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open
from typer.testing import CliRunner

import weightstore as ws
from weightstore.cli.main import app
from weightstore.errors import FormatError, KeyNotInStoreError, StoreExistsError, UnsafeFileError

INDEX = "model.safetensors.index.json"
SHARDS = {
    "model-00001-of-00002.safetensors": {"model.embed.weight": np.arange(12, dtype=np.float32).reshape(4, 3),
                                         "model.layers.0.weight": np.ones((3, 3), np.float32)},
    "model-00002-of-00002.safetensors": {"model.layers.1.weight": np.full((3, 3), 2, np.float32),
                                         "lm_head.weight": np.zeros((4, 3), np.float32)},
}


def hf_folder(folder, shards=SHARDS, weight_map=None):
    """A folder as transformers' save_pretrained writes it, made with the safetensors library."""
    folder.mkdir(exist_ok=True)
    for shard, tensors in shards.items():
        safetensors.numpy.save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    if weight_map is None:
        weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
    total = sum(t.nbytes for tensors in shards.values() for t in tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("which", ["folder", "index"])
def test_a_sharded_folder_or_its_index_opens_as_one_store(tmp_path, which):
    folder = hf_folder(tmp_path / "hf")
    with ws.open(folder if which == "folder" else folder / INDEX) as store:
        assert store.keys() == ["model/embed/weight", "model/layers/0/weight", "model/layers/1/weight",
                                "lm_head/weight"]
        assert store.info("lm_head/weight").shape == (4, 3) and store.metadata == {}
        assert np.array_equal(store["model/embed/weight"], SHARDS["model-00001-of-00002.safetensors"]
                              ["model.embed.weight"])
    assert list(ws.load(folder, scope="model/layers")) == ["0/weight", "1/weight"]


def test_only_the_shards_holding_what_is_asked_for_are_opened(tmp_path):
    folder = hf_folder(tmp_path / "hf")
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"not a safetensors file at all")
    loaded = ws.load(folder, include=["model/embed/*", "model/layers/0/*"])
    assert list(loaded) == ["model/embed/weight", "model/layers/0/weight"]
    with pytest.raises(FormatError) as caught:
        ws.load(folder, scope="lm_head")
    assert "model-00002-of-00002.safetensors" in str(caught.value)


@pytest.mark.parametrize("problem, error, says", [
    ("missing tensor", FormatError, "in the index only: 'lm_head.weight'; in the shard only: none"),
    ("unlisted tensor", FormatError, "in the shard only: 'extra'"),
    ("missing shard", FormatError, "which is missing"),
    ("escaping shard", UnsafeFileError, "not a .safetensors file beside the index"),
])
def test_each_shard_is_checked_against_the_index(tmp_path, problem, error, says):
    shards = {name: dict(tensors) for name, tensors in SHARDS.items()}
    weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
    second = "model-00002-of-00002.safetensors"
    if problem == "missing tensor":
        del shards[second]["lm_head.weight"]
    elif problem == "unlisted tensor":
        shards[second]["extra"] = np.ones(1, np.float32)
    elif problem == "missing shard":
        weight_map["lm_head.weight"] = "model-00003-of-00003.safetensors"
    else:
        weight_map["lm_head.weight"] = "../elsewhere.safetensors"
    folder = hf_folder(tmp_path / "hf", shards, weight_map)
    with pytest.raises(error) as caught:
        ws.load(folder, scope="lm_head")
    assert says in str(caught.value) and caught.value.path == str(folder / INDEX)


def test_a_damaged_index_is_refused_naming_it(tmp_path):
    folder = hf_folder(tmp_path / "hf")
    (folder / INDEX).write_text('{"metadata": {}}')
    with pytest.raises(FormatError, match="no weight_map") as caught:
        ws.open(folder)
    assert caught.value.path == str(folder / INDEX)
    (folder / INDEX).write_text("{not json")
    with pytest.raises(FormatError, match="not JSON"):
        ws.open(folder / INDEX)


def weights() -> dict[str, np.ndarray]:
    return {f"model/layers/{i}/weight": np.full((10, 10), i, np.float32) for i in range(5)}


def transformers_style_load(folder) -> dict[str, np.ndarray]:
    """What transformers' sharded loading does: the index's weight_map, each shard with safe_open,
    refusing a shard whose metadata does not say format 'pt'."""
    index = json.loads((folder / INDEX).read_text())
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), framework="numpy") as handle:
            assert handle.metadata()["format"] == "pt"
            state.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    assert sorted(state) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in state.values())
    return state


def test_save_writes_a_sharded_folder_transformers_and_safetensors_load(tmp_path):
    folder = tmp_path / "out"
    ws.save(folder, weights(), max_shard_size=900, metadata={"step": 3})
    assert sorted(p.name for p in folder.iterdir()) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [
        INDEX]
    state = transformers_style_load(folder)
    assert list(state) == [f"model.layers.{i}.weight" for i in range(5)]
    assert all(np.array_equal(state[f"model.layers.{i}.weight"], v) for i, v in enumerate(weights().values()))
    with ws.open(folder) as store:
        assert store.keys() == list(weights()) and store.metadata == {"step": 3} and store.has_checksums
    with pytest.raises(StoreExistsError):
        ws.save(folder, weights(), max_shard_size="1MB", overwrite=False)


def test_a_corrupt_shard_weightstore_wrote_fails_its_checksum(tmp_path):
    folder = tmp_path / "out"
    ws.save(folder, weights(), max_shard_size="1KB")
    shard = folder / "model-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ws.ChecksumError) as caught:
        ws.load(folder)
    assert caught.value.path == str(shard)


def test_max_shard_size_is_checked_before_anything_is_written(tmp_path):
    for bad in (0, -1, "lots", True):
        with pytest.raises(FormatError, match="max_shard_size"):
            ws.save(tmp_path / "out", weights(), max_shard_size=bad)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["model.npz", "model.h5", "model.safetensors"])
def test_max_shard_size_refuses_a_file_name_rather_than_make_a_folder_of_it(tmp_path, name):
    with pytest.raises(ws.TargetError, match=r"name the folder \(model/\) or its index"):
        ws.save(tmp_path / name, weights(), max_shard_size="1KB")
    assert not (tmp_path / name).exists()
    ws.save(f"{tmp_path / name}/", weights(), max_shard_size="1KB")  # named a folder by its '/': a folder
    ws.save(tmp_path / name, weights(), max_shard_size="1KB")  # a folder so named already
    np.testing.assert_equal(ws.load(tmp_path / name), weights())


def test_a_folder_sharded_again_holds_only_the_new_shards(tmp_path):
    folder = tmp_path / "out"
    ws.save(folder, weights(), max_shard_size="1KB")
    (folder / "README.md").write_text("kept: not a shard")
    lookalike = "model-\u0660\u0660\u0660\u0660\u0661-of-\u0660\u0660\u0660\u0660\u0663.safetensors"  # Arabic-Indic digits
    (folder / lookalike).write_text("kept: a name no save writes (\\d matched it)")
    assert len(list(folder.glob("model-0*.safetensors"))) == 3
    ws.save(folder, weights(), max_shard_size="1MB")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "model-00001-of-00001.safetensors",
                                                        lookalike, "model.safetensors.index.json"]
    np.testing.assert_equal(ws.load(folder), weights())


def test_a_folder_saved_whole_then_sharded_reads_the_new_shards(tmp_path):
    """A model.safetensors from an earlier unsharded save is read before any index (as
    from_pretrained reads it): left beside the new shards, it hid them."""
    folder = tmp_path / "out"
    folder.mkdir()
    old = {key: value + 1 for key, value in weights().items()}
    ws.save(folder / "model.safetensors", old)
    with pytest.raises(ws.StoreExistsError):  # a model is there: overwrite=False keeps it
        ws.save(folder, weights(), max_shard_size="1KB", overwrite=False)
    ws.save(folder / "other.safetensors.index.json", weights(), max_shard_size="1KB")  # from_pretrained reads no such index
    assert (folder / "model.safetensors").exists()
    ws.save(folder, weights(), max_shard_size="1KB")
    assert not (folder / "model.safetensors").exists()
    np.testing.assert_equal(ws.load(folder), weights())
    (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")  # as in the HF cache
    ws.save(tmp_path / "elsewhere.safetensors", old)
    ws.save(folder, weights(), max_shard_size="1KB")
    assert not os.path.lexists(folder / "model.safetensors") and (tmp_path / "elsewhere.safetensors").exists()
    np.testing.assert_equal(ws.load(folder), weights())


def test_max_shard_size_in_bytes_may_say_B(tmp_path):
    """"give a positive number of bytes" is what a refusal says: "900B" is one, as "900" is."""
    source = tmp_path / "m.npz"
    ws.save(source, weights())
    result = run("convert", source, tmp_path / "out", "--max-shard-size", "900B")
    assert result.exit_code == 0, result.output
    ws.save(tmp_path / "plain", weights(), max_shard_size=900)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    transformers_style_load(tmp_path / "out")


def test_a_remote_sharded_folder_reads_shards_only_for_the_keys_asked(tmp_path):
    import fsspec

    url = f"memory://hf-{tmp_path.name}/model"
    ws.save(url, weights(), max_shard_size=900)
    fs = fsspec.filesystem("memory")
    assert fs.exists(f"/hf-{tmp_path.name}/model/{INDEX}")
    fs.pipe(f"/hf-{tmp_path.name}/model/model-00003-of-00003.safetensors", b"damaged")
    assert list(ws.load(url, scope="model/layers/0")) == ["weight"]
    with ws.open(f"{url}/{INDEX}") as store:
        assert np.array_equal(store["model/layers/3/weight"], weights()["model/layers/3/weight"])
        with pytest.raises(KeyNotInStoreError):
            store["nope"]


def test_a_remote_model_folder_reads_its_model_safetensors_first_as_a_local_one(tmp_path):
    """A remote folder was read only through an index: one model.safetensors (what
    save_pretrained writes below its shard size) was no model, and beside an index was passed over."""
    url = f"memory://hf-{tmp_path.name}/model"
    single = {key: value + 1 for key, value in weights().items()}
    ws.save(f"{url}/model.safetensors", single)
    np.testing.assert_equal(ws.load(url), single)
    import fsspec

    fsspec.filesystem("memory").pipe(f"/hf-{tmp_path.name}/model/{INDEX}", b"{}")  # beside it, an index
    np.testing.assert_equal(ws.load(url), single)
    ws.save(url, weights(), max_shard_size=900)  # re-sharded: the model.safetensors that would hide it goes
    np.testing.assert_equal(ws.load(url), weights())


def test_ws_convert_writes_and_ws_ls_reads_a_sharded_folder(tmp_path):
    source = tmp_path / "m.npz"
    ws.save(source, weights())
    result = run("convert", source, tmp_path / "out", "--max-shard-size", "900")
    assert result.exit_code == 0, result.output
    transformers_style_load(tmp_path / "out")
    listing = run("ls", tmp_path / "out")
    assert listing.exit_code == 0 and "model/layers/4/weight" in listing.output


def test_torch_assign_takes_a_sharded_folder(tmp_path):
    torch = pytest.importorskip("torch")
    from weightstore.adapters import torch as torch_adapter

    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ws.save(tmp_path / "out", torch_adapter.export(source), max_shard_size=100)
    target = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert torch_adapter.assign(target, tmp_path / "out").ok
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_model_folder_of_one_safetensors_file_opens_as_from_pretrained_reads_it(tmp_path):
    """transformers' save_pretrained writes one model.safetensors beside config.json below its
    shard size: the folder was refused as holding no TF checkpoint."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from weightstore.adapters import torch as torch_adapter

    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    (tmp_path / "model").mkdir()
    save_file(source.state_dict(), str(tmp_path / "model" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "model" / "config.json").write_text('{"model_type": "toy"}')
    assert sorted(ws.load(tmp_path / "model")) == sorted(name.replace(".", "/") for name in source.state_dict())
    target = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert torch_adapter.assign(target, tmp_path / "model").ok
    x = torch.ones(3, 4)
    assert torch.equal(target(x), source(x))
    assert "0/weight" in CliRunner().invoke(app, ["ls", str(tmp_path / "model")]).output


def test_a_model_folder_of_torch_save_pickles_is_refused_naming_the_file(tmp_path):
    torch = pytest.importorskip("torch")
    (tmp_path / "model").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "model" / "pytorch_model.bin")
    with pytest.raises(FormatError, match=r"model: holds its weights as PyTorch torch.save pickles "
                                          r"\(pytorch_model\.bin\); weightstore never unpickles"):
        ws.load(tmp_path / "model")
    index = tmp_path / "model" / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "pytorch_model-00001-of-00001.bin"}}))
    with pytest.raises(FormatError, match=r"index\.json: is the index of PyTorch torch\.save shards \(pickles\)"):
        ws.load(index)


def test_a_folder_holding_a_tf_checkpoint_too_opens_as_the_checkpoint_as_before(tmp_path):
    import tf_forge

    tf_forge.write(tmp_path / "ckpt", {"tf/w": np.ones(2, np.float32)})
    safetensors.numpy.save_file({"hf.w": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"never read")
    assert list(ws.load(tmp_path)) == ["tf/w"]


def test_a_folder_holding_model_safetensors_and_an_index_opens_its_model_safetensors_as_from_pretrained(tmp_path):
    """transformers' from_pretrained reads model.safetensors before the index (save_pretrained
    sharding a folder again leaves an earlier model.safetensors): the index was read instead,
    so a torch.assign of the folder gave other weights than from_pretrained."""
    folder = hf_folder(tmp_path / "hf")
    single = {"model.embed.weight": np.full((4, 3), 7, np.float32)}
    safetensors.numpy.save_file(single, str(folder / "model.safetensors"), metadata={"format": "pt"})
    loaded = ws.load(folder, names="torch")
    assert list(loaded) == ["model/embed/weight"]
    assert np.array_equal(loaded["model/embed/weight"], single["model.embed.weight"])
    assert list(ws.load(folder / INDEX)) == ["model/embed/weight", "model/layers/0/weight", "model/layers/1/weight",
                                             "lm_head/weight"]  # the index itself, named, is still the index


@pytest.mark.parametrize("depth", [101, 900])
def test_index_metadata_nested_past_what_repr_can_show_is_refused_naming_the_index(tmp_path, depth):
    """The stdlib parses some 1,000 levels; ``json.dumps`` of such metadata (``ws ls --json``)
    raises RecursionError a little deeper in the stack, so metadata nests at most 100 levels."""
    safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"metadata": {"total_size": 8, "x": %s}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}'
                     % ("[" * depth + "]" * depth))
    with pytest.raises(FormatError, match="index metadata nests objects and arrays more than 100 levels") as caught:
        ws.open(tmp_path)
    assert caught.value.path == str(index)
    result = CliRunner().invoke(app, ["ls", "--json", str(tmp_path)])
    assert result.exit_code == 1 and '"type": "FormatError"' in result.output


@pytest.mark.parametrize("change", [
    lambda document: document["metadata"].update(step=4),  # a digit changed
    lambda document: document["weight_map"].pop("model.layers.4.weight"),  # a shard left out: one tensor fewer
    lambda document: document["weightstore"].update(checksun=document["weightstore"].pop("checksum")),
    lambda document: document["weightstore"].update(checksum=None),
])
def test_a_changed_index_of_a_folder_weightstore_wrote_is_refused_naming_it(tmp_path, change):
    """Found by fuzzing: no shard's checksum covers the index's metadata or which shards there
    are, so a changed metadata value or a dropped entry read back as they stood; the index's
    own CRC-32 covers both. A folder transformers wrote has none and reads as before."""
    folder = tmp_path / "out"
    ws.save(folder, weights(), max_shard_size=900, metadata={"step": 3})
    document = json.loads((folder / INDEX).read_text())
    change(document)
    (folder / INDEX).write_text(json.dumps(document, indent=2))
    with pytest.raises(FormatError) as caught:
        ws.load(folder)
    assert INDEX in str(caught.value.path)


def test_an_index_weightstore_wrote_before_its_checksum_still_reads(tmp_path):
    folder = tmp_path / "out"
    ws.save(folder, weights(), max_shard_size=900, metadata={"step": 3})
    document = json.loads((folder / INDEX).read_text())
    del document["weightstore"]["checksum"]
    (folder / INDEX).write_text(json.dumps(document, indent=2))
    with ws.open(folder) as store:
        assert store.metadata == {"step": 3} and store.has_checksums and len(store.read()) == 5


@pytest.mark.parametrize("cut", [
    lambda document: document.pop("weightstore"),  # as transformers writes it: no checksum
    lambda document: document["weightstore"].pop("checksum"),  # as weightstore wrote it before its checksum
])
@pytest.mark.parametrize("which", ["everything", "a shard"])
def test_an_index_without_a_checksum_whose_weight_map_is_cut_is_refused_naming_it(tmp_path, cut, which):
    """An index whose weight_map was emptied (or lost every tensor of one shard) read as a model
    with fewer tensors, none at all, without a word; save_pretrained never writes such a map, and its
    shards' names count them."""
    folder = tmp_path / "out"
    ws.save(folder, weights(), max_shard_size=900)
    document = json.loads((folder / INDEX).read_text())
    cut(document)
    last = max(document["weight_map"].values())
    document["weight_map"] = {} if which == "everything" else {
        key: shard for key, shard in document["weight_map"].items() if shard != last}
    (folder / INDEX).write_text(json.dumps(document))
    with pytest.raises(FormatError, match="weight_map is (empty|cut)") as caught:
        ws.load(folder)
    assert INDEX in str(caught.value.path)
    assert run("ls", folder).exit_code != 0


@pytest.mark.parametrize("written", ["now", "before the checksum"])
def test_an_empty_model_weightstore_saved_sharded_reads_back_empty(tmp_path, written):
    """Before its index carried a checksum, weightstore wrote an empty model's index with no
    checksum and a total_size of 0 (a cut map keeps its total): that folder still reads."""
    ws.save(tmp_path / "empty", {}, max_shard_size=900)
    if written == "before the checksum":
        document = json.loads((tmp_path / "empty" / INDEX).read_text())
        document["weightstore"].pop("checksum")
        (tmp_path / "empty" / INDEX).write_text(json.dumps(document, indent=2))
    assert ws.load(tmp_path / "empty") == {}


_UNDER_A_FILE_SIZE_LIMIT = (  # a write past 1 MB fails with EFBIG, as a full disk fails with ENOSPC
    "import resource, runpy, signal, sys\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
    "sys.argv[0] = 'ws'\n"
    "runpy.run_module('weightstore', run_name='__main__')\n"
)


def ws_under_a_file_size_limit(*args):
    """The real ``ws`` command in a process of its own whose writes past 1 MB fail."""
    return subprocess.run([sys.executable, "-c", _UNDER_A_FILE_SIZE_LIMIT, *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_a_sharded_convert_that_fails_midway_leaves_no_shards_behind(tmp_path):
    """The second shard passes the file-size limit: the first, already in place, is removed
    with the folder the convert made, so no half of a model is left to look like one."""
    ws.save(tmp_path / "new.npz", {"a": np.ones(1000, np.float32), "b": np.ones(1 << 19, np.float32)})
    done = ws_under_a_file_size_limit("convert", tmp_path / "new.npz", tmp_path / "out", "--max-shard-size", "100KB")
    assert done.returncode == 1 and "model-00002-of-00002.safetensors" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_sharded_folder_whose_convert_failed_midway_is_refused_never_read_half_new(tmp_path):
    """Found as a user: a convert over an existing sharded folder that failed at its second
    shard (disk full, Ctrl-C) left the new first shard beside the old index and old second
    shard, and the folder read back as half new, half old weights without a word."""
    folder = tmp_path / "model"
    ws.save(folder, {"a": np.zeros(1000, np.float32), "b": np.zeros(1 << 19, np.float32)}, max_shard_size="100KB")
    ws.save(tmp_path / "new.npz", {"a": np.ones(1000, np.float32), "b": np.ones(1 << 19, np.float32)})
    done = ws_under_a_file_size_limit("convert", tmp_path / "new.npz", folder, "--max-shard-size", "100KB")
    assert done.returncode == 1, done.stderr
    with pytest.raises(FormatError, match="model-00001-of-00002.safetensors"):
        ws.load(folder)


_KILLED_ONCE_ITS_FIRST_SHARD_IS_IN = """
import os, runpy, sys
import weightstore.io.commit as commit
shard = sys.argv.pop(1)
before, fsync_folder = os.stat(shard).st_ino, commit.fsync_folder
def killed_once_in(path, **words):
    fsync_folder(path, **words)
    if os.stat(shard).st_ino != before:
        os._exit(137)  # as SIGKILL (the OOM killer, a preempted node) would: nothing cleans up
commit.fsync_folder = killed_once_in
sys.argv[0] = "ws"
runpy.run_module("weightstore", run_name="__main__")
"""


def a_folder_save_pretrained_wrote(tmp_path):
    """Two shards of zeros and an index as ``save_pretrained`` writes it: no save time recorded."""
    folder = tmp_path / "model"
    folder.mkdir()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name, key in zip(names, ["a", "b"], strict=True):
        safetensors.numpy.save_file({key: np.zeros(1 << 16, np.float32)}, str(folder / name))
    weight_map = dict(zip("ab", names, strict=True))
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": 1 << 19}, "weight_map": weight_map}))
    return folder, names


def test_a_convert_killed_over_a_folder_another_tool_wrote_is_refused_never_read_half_new(tmp_path):
    """An index ``save_pretrained`` wrote records no save time, so a shard of the new save beside
    it could not be told from its own: ``ws convert --max-shard-size`` over such a folder, killed
    once its first shard was in place, read back as half new, half old weights without a word.
    That index goes before the first shard: the killed overwrite leaves no model to misread."""
    folder, names = a_folder_save_pretrained_wrote(tmp_path)
    assert ws.load(folder)["a"].sum() == 0
    ws.save(tmp_path / "new.npz", {"a": np.ones(1 << 16, np.float32), "b": np.ones(1 << 16, np.float32)})
    done = subprocess.run([sys.executable, "-c", _KILLED_ONCE_ITS_FIRST_SHARD_IS_IN, str(folder / names[0]), "convert",
                           str(tmp_path / "new.npz"), str(folder), "--max-shard-size", "300KB"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 137, done.stderr
    assert safetensors.numpy.load_file(str(folder / names[0]))["a"].sum() == 1 << 16  # the new shard is in
    with pytest.raises(ws.WeightStoreError):
        ws.load(folder)


def test_a_convert_failing_at_its_first_shard_over_a_folder_another_tool_wrote_leaves_its_model(tmp_path):
    """The first shard passes the file-size limit (as a full disk fails it): no shard of the new
    save was ever placed, yet the save_pretrained index was removed up front, and the folder,
    which a failed write leaves as it was, no longer loaded."""
    folder, names = a_folder_save_pretrained_wrote(tmp_path)
    ws.save(tmp_path / "new.npz", {"a": np.ones(1 << 19, np.float32), "b": np.ones(1 << 16, np.float32)})
    done = ws_under_a_file_size_limit("convert", tmp_path / "new.npz", folder, "--max-shard-size", "300KB")
    assert done.returncode == 1 and names[0] in done.stderr, done.stderr
    loaded = ws.load(folder)
    assert sorted(loaded) == ["a", "b"] and all(np.all(value == 0) for value in loaded.values())


def test_a_sharded_save_that_fails_after_its_index_landed_keeps_the_shards_it_names(tmp_path, monkeypatch):
    """The folder's fsync after the index's rename fails (EIO on a network disk; a Ctrl-C there
    is the same): the save says so, but the index in place names the new shards, and removing
    them as a save cut short left an index naming missing shards, the earlier model gone too."""
    folder = tmp_path / "model"
    ws.save(folder, {"a": np.zeros(1000, np.float32), "b": np.zeros(1 << 16, np.float32)}, max_shard_size="100KB")
    fsync = os.fsync

    def fails_once_the_index_is_in(fd):
        fsync(fd)
        if os.path.isdir(f"/proc/self/fd/{fd}") and (folder / INDEX).stat().st_mtime_ns > saved:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    saved = (folder / INDEX).stat().st_mtime_ns
    monkeypatch.setattr(os, "fsync", fails_once_the_index_is_in)
    with pytest.raises(OSError, match="Input/output error"):
        ws.save(folder, {"a": np.ones(1000, np.float32), "b": np.ones(1 << 16, np.float32)},
                max_shard_size="100KB", overwrite=True)
    monkeypatch.undo()
    loaded = ws.load(folder)
    assert sorted(loaded) == ["a", "b"] and all(np.all(value == 1) for value in loaded.values())


def test_a_shard_of_another_save_beside_an_index_is_refused_naming_it(tmp_path):
    """What a reader finds while an overwrite is under way, or after one was killed before it
    could clean up: a shard the index's save did not write. Each shard records the save's time,
    as the index does."""
    first, second = tmp_path / "first", tmp_path / "second"
    ws.save(first, {"a": np.zeros(1000, np.float32), "b": np.zeros(1 << 19, np.float32)}, max_shard_size="100KB")
    ws.save(second, {"a": np.ones(1000, np.float32), "b": np.ones(1 << 19, np.float32)}, max_shard_size="100KB")
    shard = "model-00001-of-00002.safetensors"
    os.replace(second / shard, first / shard)
    with pytest.raises(FormatError, match="another save") as caught:
        ws.load(first)
    assert shard in str(caught.value) and INDEX in str(caught.value.path)
