"""The files PyTorch users have: state_dict names in safetensors, npz and our own files, both ways."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from typer.testing import CliRunner  # noqa: E402

import weightstore as ws  # noqa: E402
from weightstore.adapters import torch as torch_adapter  # noqa: E402
from weightstore.cli.main import app  # noqa: E402
from weightstore.core.names import key_of_torch_name, torch_name_of_key  # noqa: E402
from weightstore.errors import FormatError, InvalidKeyError  # noqa: E402

nn = torch.nn


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_torch_names_and_keys_map_exactly_both_ways():
    assert key_of_torch_name("features.0.weight") == "features/0/weight"
    assert torch_name_of_key("features/0/weight") == "features.0.weight"
    with pytest.raises(InvalidKeyError, match="'a/b.c' holds '/'"):
        key_of_torch_name("a/b.c")
    with pytest.raises(InvalidKeyError, match="^tensor 'dense.1/kernel': has a '.' inside a segment") as caught:
        torch_name_of_key("dense.1/kernel")
    assert caught.value.key == "dense.1/kernel"
    with pytest.raises(InvalidKeyError, match="no key"):
        key_of_torch_name("a..b")


def test_a_file_safetensors_torch_wrote_goes_back_into_its_module(tmp_path):
    source, target = net(0), net(1)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(source.state_dict(), str(path))
    with ws.open(path) as store:
        assert "0/weight" in store and "1/running_mean" in store and not store.has_checksums
    report = torch_adapter.assign(target, path)
    assert report.ok and len(report.assigned) == len(source.state_dict())
    assert_same_state(source, target)


def test_a_hugging_face_file_keeps_its_metadata_and_names(tmp_path):
    path = tmp_path / "model.safetensors"
    weights = {"model.embed_tokens.weight": np.ones((5, 2), np.float32), "lm_head.weight": np.zeros((5, 2), np.float32)}
    import safetensors.numpy

    safetensors.numpy.save_file(weights, str(path), metadata={"format": "pt"})
    with ws.open(path) as store:
        assert sorted(store) == ["lm_head/weight", "model/embed_tokens/weight"]
        assert store.metadata == {"format": "pt"}
    assert list(ws.load(path, names="file")) == sorted(weights)


def test_state_dicts_and_dotted_keys_assign_as_they_are(tmp_path):
    source, target = net(0), net(1)
    assert torch_adapter.assign(target, safetensors_torch.load_file(_saved(source, tmp_path))).ok
    assert_same_state(source, target)
    dotted = torch_adapter.export(source, names="torch")
    assert list(dotted)[:2] == ["0.weight", "0.bias"]
    ws.save(tmp_path / "dotted.npz", dotted)
    other = net(2)
    assert torch_adapter.assign(other, tmp_path / "dotted.npz").ok
    assert_same_state(source, other)


def _saved(module: nn.Module, folder) -> str:
    path = str(folder / "sd.safetensors")
    safetensors_torch.save_file(module.state_dict(), path)
    return path


@pytest.mark.parametrize("how", ["save", "export"])
def test_files_written_with_torch_names_load_into_load_state_dict(tmp_path, how):
    source, target = net(0), net(1)
    path = tmp_path / "m.safetensors"
    if how == "save":
        ws.save(path, torch_adapter.export(source), names="torch")
    else:
        ws.save(path, torch_adapter.export(source, names="torch"))
    target.load_state_dict(safetensors_torch.load_file(str(path)))
    assert_same_state(source, target)
    with ws.open(path) as store:  # ws.save(names="torch") keeps the keys; the export's keys are the names
        assert store.has_checksums and ("0/weight" in store) == (how == "save")
    again = net(3)
    assert torch_adapter.assign(again, path).ok
    assert_same_state(source, again)


def test_torch_names_are_refused_where_no_key_reads_back(tmp_path):
    with pytest.raises(InvalidKeyError, match=r"m\.safetensors.*'dense\.1/kernel'"):
        ws.save(tmp_path / "m.safetensors", {"dense.1/kernel": np.ones(2)}, names="torch")
    assert not (tmp_path / "m.safetensors").exists()
    with pytest.raises(ValueError, match="names='tf'"):
        ws.save(tmp_path / "m.safetensors", {"a": np.ones(2)}, names="tf")
    module = nn.Module()
    module.register_buffer("a/b", torch.ones(2))
    with pytest.raises(InvalidKeyError, match="'a/b' holds '/'"):
        torch_adapter.export(module)


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors"])
def test_a_saved_state_dict_remembers_its_torch_names(tmp_path, suffix):
    """``ws.save`` of ``state_dict()`` kept ``features.0.weight`` as npz and HDF5 keys: a scope,
    ``--include '1/*'`` or ``ws import --scope`` (``members/0/1.weight``) then matched nothing
    or mixed both spellings. The file keeps the names ``load_state_dict`` takes, and is read by
    the keys ``torch.export`` gives, through every verb and a copy of the file."""
    source = net(0)
    path = tmp_path / f"m{suffix}"
    ws.save(path, source.state_dict())
    with ws.open(path) as store:
        assert store.keys() == list(torch_adapter.export(source)) and store.has_checksums
        assert [store.stored_names()[key] for key in store] == list(source.state_dict())  # np.load's, h5py's
    assert ws.load(path, scope="1").keys() == torch_adapter.export(source[1]).keys()
    target = net(1)
    assert torch_adapter.assign(target, path).ok
    assert_same_state(source, target)
    copy = tmp_path / f"copy{suffix}"
    assert run("convert", path, copy).exit_code == 0
    with ws.open(copy) as store:
        assert [store.stored_names()[key] for key in store] == list(source.state_dict())
    assert run("import", path, "--into", tmp_path / "ens.npz", "--scope", "members/0").exit_code == 0
    assert list(ws.load(tmp_path / "ens.npz")) == [f"members/0/{key}" for key in torch_adapter.export(source)]
    listed = run("ls", path)
    assert listed.exit_code == 0 and "1/running_mean" in listed.output and "1.running_mean" not in listed.output


@pytest.mark.parametrize("name", ["scale..x", "scale.", ".scale"])
def test_a_dict_of_tensors_under_names_torch_never_gives_is_saved_and_published_as_written(tmp_path, name):
    """A dict of torch tensors whose dotted names make no key (an empty module name, which
    PyTorch never gives) is no state_dict: saved and published under its names as written, as
    before state_dicts were told apart; it was refused ("torch name 'scale..x' is no key")."""
    weights = {name: torch.ones(2), "c.d": torch.zeros(1)}
    ws.save(tmp_path / "m.npz", weights)
    assert sorted(ws.load(tmp_path / "m.npz")) == sorted(weights)
    ws.publish(tmp_path / "run", weights, step=1)
    assert sorted(ws.load(ws.latest(tmp_path / "run"))) == sorted(weights)


def test_names_torch_reads_an_npz_of_a_state_dict(tmp_path):
    source = net(0)
    np.savez(tmp_path / "sd.npz", **{k: v.numpy() for k, v in source.state_dict().items()})
    with ws.open(tmp_path / "sd.npz", names="torch") as store:
        assert "0/weight" in store and "1/num_batches_tracked" in store
    np.savez(tmp_path / "bad.npz", **{"a/b.c": np.ones(1)})
    with pytest.raises(FormatError, match="holds '/'") as caught:
        ws.open(tmp_path / "bad.npz", names="torch")
    assert caught.value.path == str(tmp_path / "bad.npz")


def test_ws_convert_round_trips_through_keras_names_to_load_state_dict(tmp_path):
    source, target = net(0), net(1)
    path = _saved(source, tmp_path)
    keras = tmp_path / "keras.npz"
    assert run("convert", path, keras, "--layout", "torch-to-keras").exit_code == 0
    assert {"0/kernel", "1/gamma", "1/moving_variance", "3/kernel"} <= set(ws.load(keras))
    back = tmp_path / "back.safetensors"
    assert run("convert", keras, back, "--layout", "keras-to-torch").exit_code == 0
    state = safetensors_torch.load_file(str(back))
    target.load_state_dict(state)  # strict: batch norm's step counter, which Keras lacks, may be absent
    for key, value in state.items():
        assert torch.equal(value, source.state_dict()[key]), key
    keys = tmp_path / "keys.safetensors"
    assert run("convert", keras, keys, "--layout", "keras-to-torch", "--names", "keys").exit_code == 0
    assert "0/weight" in safetensors_torch.load_file(str(keys))


def test_ws_export_keeps_a_foreign_files_metadata_under_its_own_names(tmp_path):
    path = tmp_path / "lib.safetensors"
    import safetensors.numpy

    safetensors.numpy.save_file({"a.w": np.ones(2, np.float32)}, str(path), metadata={"format": "pt", "n": "1"})
    out = tmp_path / "out.npz"
    result = run("export", path, "-o", out, "--names", "torch")
    assert result.exit_code == 0, result.output
    with ws.open(out) as store:
        assert store.metadata == {"source": str(path), "source_kind": "file without a weightstore manifest", "format": "pt", "n": "1"}
        assert store.keys() == ["a/w"] and store.stored_names() == {"a/w": "a.w"}  # npz remembers the names


# -- torch.save files: recognised, never unpickled ----------------------------------------------

class _MakesAFile:
    """Unpickling this opens (creates) the file at ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil_pickle(path) -> bytes:
    import pickle

    return pickle.dumps({"w": _MakesAFile(str(path))}, protocol=2)


def _torch_zip(path, pickled: bytes) -> None:
    """What torch.save writes, with ``pickled`` as its data.pkl."""
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/version", "3\n")


@pytest.mark.parametrize("kind", ["zip", "legacy", "hostile zip", "hostile pickle"])
def test_torch_save_files_are_refused_saying_what_they_are_and_how_to_convert(tmp_path, kind):
    made = tmp_path / "made-by-unpickling"
    path = tmp_path / ("pytorch_model.bin" if kind.startswith("hostile") else "model.pt")
    if kind == "zip":
        torch.save(net().state_dict(), path)
    elif kind == "legacy":
        torch.save(net().state_dict(), path, _use_new_zipfile_serialization=False)
    elif kind == "hostile zip":
        _torch_zip(path, _evil_pickle(made))
    else:
        path.write_bytes(_evil_pickle(made))
    what = {"zip": "PyTorch torch.save file", "legacy": "legacy format", "hostile zip": "PyTorch torch.save file",
            "hostile pickle": "a Python pickle"}[kind]
    with pytest.raises(FormatError, match=what) as caught:
        ws.open(path)
    message = str(caught.value)
    assert caught.value.path == str(path)
    assert "never unpickles" in message and "did not unpickle this one" in message
    assert "ws.save('model.safetensors', torch.load(f, weights_only=True))" in message
    with pytest.raises(FormatError, match="never unpickles"):
        torch_adapter.assign(net(), path)
    result = run("ls", path)
    assert result.exit_code == 1 and "never unpickles" in result.output
    assert not made.exists()


def test_the_conversion_the_refusal_suggests_works_for_tied_and_bfloat16_state_dicts(tmp_path):
    """``safetensors.torch.save_file`` refuses tensors that share memory (tied weights): the hint
    now names ``ws.save``, which takes such a state dict as it is."""
    model = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)).to(torch.bfloat16)
    model[1].weight = model[0].weight
    torch.save(model.state_dict(), tmp_path / "model.pt")
    ws.save(tmp_path / "model.safetensors", torch.load(tmp_path / "model.pt", weights_only=True))
    fresh = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)).to(torch.bfloat16)
    fresh[1].weight = fresh[0].weight
    assert torch_adapter.assign(fresh, tmp_path / "model.safetensors").ok
    assert_same_state(fresh, model)


def test_a_torchscript_archive_is_refused_as_pytorch_saying_how_to_convert(tmp_path):
    """torch.jit.save writes its tensors (``m/data/0``) before its pickles: only a zip whose first
    member is data.pkl was recognised, so this one was read as an npz and refused as "member
    'm/data/0' is not an .npy array", without a word of PyTorch or of a conversion."""
    source = net()
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(source), path)
    with pytest.raises(FormatError, match="is a PyTorch TorchScript archive") as caught:
        ws.open(path)
    message = str(caught.value)
    assert caught.value.path == str(path) and "never unpickles" in message
    assert "ws.save('model.safetensors', torch.jit.load(f).state_dict())" in message
    result = run("ls", path)
    assert result.exit_code == 1 and "TorchScript archive" in result.output
    ws.save(tmp_path / "model.safetensors", torch.jit.load(path).state_dict())  # the conversion it names
    fresh = net(seed=1)
    assert torch_adapter.assign(fresh, tmp_path / "model.safetensors").ok
    assert_same_state(fresh, source)


def test_a_torch_zip_whose_pickle_is_not_its_first_member_is_refused_unread(tmp_path):
    import zipfile

    made = tmp_path / "made-by-unpickling"
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/version", "3\n")
        archive.writestr("archive/data.pkl", _evil_pickle(made))
    with pytest.raises(FormatError, match="is a PyTorch torch.save file.*never unpickles"):
        ws.open(path)
    assert not made.exists()


def test_a_conv_bn_linear_model_saved_by_safetensors_torch_reads_whatever_its_header_length(tmp_path):
    """``safetensors.torch.save_file`` of this Conv/BN/Linear model writes a header of 600 bytes;
    a little metadata takes it to 640, whose length starts with pickle's magic (``80 02``), and the
    file was refused as "a Python pickle". It is read as the safetensors file its name says."""
    import struct

    source = net()
    path = tmp_path / "model.safetensors"
    for pad in range(64):
        safetensors_torch.save_file(source.state_dict(), str(path), metadata={"note": "x" * pad})
        with open(path, "rb") as handle:
            if struct.unpack("<Q", handle.read(8))[0] == 640:
                break
    else:
        raise AssertionError("no padding gives a header of 640 bytes")
    fresh = net(seed=1)
    assert torch_adapter.assign(fresh, path).ok
    assert_same_state(fresh, source)
    result = run("ls", path)
    assert result.exit_code == 0 and "0/weight" in result.output, result.output


def test_a_published_state_dict_is_a_version_of_its_keys(tmp_path):
    """A version published from ``state_dict()`` kept ``features.0.weight`` as its keys, where
    ``ws.save`` of the same dict reads back by ``features/0/weight``: a follower's ``scope=``
    found nothing. Published or saved, the keys are the ones ``torch.export`` gives."""
    source = net(0)
    version = ws.publish(tmp_path / "run", source.state_dict(), step=1)
    assert ws.load(version, scope="1").keys() == torch_adapter.export(source[1]).keys()
    target = net(1)
    assert torch_adapter.assign(target, ws.latest(tmp_path / "run")).ok
    assert_same_state(source, target)


def test_ws_diff_pairs_a_state_dict_saved_before_its_names_were_read_as_keys(tmp_path):
    """``ws.save`` of ``state_dict()`` kept ``3.bias`` as the key before it read the name as
    ``3/bias``: yesterday's file against today's of the same weights listed every tensor as
    removed and added, and exited 1. Each is read by the keys of the other now, either way round."""
    source = net(0)
    old, new = tmp_path / "old.npz", tmp_path / "new.npz"
    ws.save(old, {name: value.numpy() for name, value in source.state_dict().items()})  # as saved before
    ws.save(new, source.state_dict())
    for a, b in ((old, new), (new, old)):
        result = run("diff", a, b)
        assert result.exit_code == 0 and "0 added, 0 removed, 0 changed, 9 unchanged" in result.output, result.output
    with torch.no_grad():
        source[3].bias.add_(1.0)
    ws.save(new, source.state_dict(), overwrite=True)
    result = run("diff", old, new)
    assert result.exit_code == 1 and "0 added, 0 removed, 1 changed" in result.output, result.output
    assert "3/bias" in result.output and "3.bias" not in result.output
    ws.save(tmp_path / "keys.npz", {"3.bias": np.zeros(2, np.float32)})  # a file of keys alone is as it was
    result = run("diff", tmp_path / "keys.npz", old)
    assert result.exit_code == 1 and "8 added, 0 removed, 1 changed" in result.output, result.output
    ws.save(tmp_path / "odd.npz", {"3..bias": np.zeros(2, np.float32)})  # no key reads so: compared as it is
    result = run("diff", tmp_path / "odd.npz", new)
    assert result.exit_code == 1 and "9 added, 1 removed" in result.output, result.output
