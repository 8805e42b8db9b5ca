"""The ``ws`` command, through ``CliRunner`` and, a few times, the installed console script.

Sources are real TF1/TF2 checkpoints and Keras files made once per module by the builders in
``test_checkpoints``; every file a test writes goes under its ``tmp_path``. Subprocess runs
that import TensorFlow cost seconds each, so there are only a few.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from rich.cells import cell_len
from rich.console import Console
from typer.testing import CliRunner

import tf_forge
import weightstore as ws
from hostile import hostile_keras
from in_turn import ws_in_turn
from polling import wait_until
from weightstore.cli import render, transfer
from weightstore.cli.guard import GuardedGroup
from weightstore.cli.main import app

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from tf_files import copy_checkpoint, restore_with_saver, same_architecture  # noqa: E402

WS = os.path.join(os.path.dirname(sys.executable), "ws")
COMMANDS = ["export", "import", "ls", "diff", "convert", "verify", "versions", "follow", "clean"]


def run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_error_line(result, *fragments: str, status: int = 1) -> str:
    """The error a failed command printed: exit 1 (2 for ``diff`` and ``verify`` that cannot
    tell), one line on stderr, no traceback."""
    assert result.exit_code == status, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "m.npz"
    ws.save(path, {"dense/w": np.arange(6, dtype=np.float32).reshape(2, 3), "dense/b": np.ones(3, np.float32),
                   "head/w": np.zeros((3, 1), np.float32)}, metadata={"run": "a"})
    return path


# -- help and usage ------------------------------------------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = run(command, "--help")
    assert result.exit_code == 0
    assert "Usage" in result.stdout
    if command not in ("versions", "follow"):  # those belong to cli/sync.py
        assert f"ws {command} " in result.stdout  # the example


@pytest.mark.parametrize("args, sentence", [
    (["follow", "--help"], "a mistyped path would otherwise wait forever. Pass --wait when it is only not there yet"),
    (["--help"], "attempt folders of sharded versions that no index names, rank files in an index's attempt folder "
                 "that it does not name, indexes LATEST never reached, and (on S3) the unfinished uploads of killed "
                 "writers."),
])
def test_help_shows_each_paragraph_whole_not_as_the_docstring_wrapped_it(args, sentence):
    """A docstring is wrapped at 100 columns in the source; on a wide terminal its paragraph is one line."""
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0
    assert sentence in result.stdout, result.stdout


def test_export_help_says_when_a_keras_archive_needs_model_keys():
    """--trainable-only on a .keras asks the model Keras builds: its help says so in words."""
    result = run("export", "--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.replace("│", " ").split())
    assert ("built-in layers is keyed so without it; it is needed for the layers ws's table lacks, keras-hub's too, "
            "but refuses a class of your own, which no ws process can import; --trainable-only implies it, "
            "asking the built model which variables train") in text, text


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_help_names_values_in_words_not_python_types(command):
    result = run(*command, "--help")
    assert result.exit_code == 0
    assert not re.search(r"<(str|int|float|list\[\w+\]|\w+)>", result.stdout), result.stdout


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and result.stdout == f"weightstore {ws.__version__}\n"


@pytest.mark.parametrize("words", [["--json", "--version"], ["--version", "--json"]])
def test_version_with_json_is_one_object(words):
    result = run(*words)
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"command": "version", "ok": True, "version": ws.__version__}


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_help_shows_flags_as_flags(command):
    result = run(*command, "--help")
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout
    flags = {(): ["--quiet", "--debug", "--help"], ("export",): ["--trainable-only", "--compress"],
             ("import",): ["--overwrite"], ("ls",): ["--json"]}.get(tuple(command), ["--help"])
    for flag in flags:  # each on its line with its help, and no value after it
        line = next(line for line in result.stdout.splitlines()
                    if line.lstrip().startswith("│") and line.strip("│ *").startswith(flag))
        assert line.split(flag, 1)[1].lstrip(" │-q").split()[0][0].isupper(), line


def test_no_arguments_shows_help_and_usage_errors_exit_2(store, tmp_path):
    assert "export" in run().output
    assert run("export", store).exit_code == 2  # -o is required
    assert run("import", store, "--into", tmp_path / "x.npz", "--map", "no-equals-sign").exit_code == 2
    assert run("diff", store, store, "--atol", "-1").exit_code == 2
    assert run("nonsense").exit_code == 2


def test_unknown_layout_is_a_usage_error_naming_the_choices(store, tmp_path):
    """Like every other bad option value: exit 2, typer's usage message, nothing opened or written."""
    result = CliRunner().invoke(app, ["convert", str(store), str(tmp_path / "out.npz"), "--layout", "keras-to-mxnet"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--layout'" in result.stderr and "'keras-to-mxnet'" in result.stderr
    assert "keras-to-torch, torch-to-keras, keras-to-flax, flax-to-keras" in result.stderr
    assert not (tmp_path / "out.npz").exists()


# -- export --------------------------------------------------------------------------------

def test_export_tf1_folder_takes_the_latest_checkpoint(made, tmp_path):
    out = tmp_path / "out.npz"
    result = run("export", os.path.dirname(made["tf1"]), "-o", out, "--scope", "model", "--exclude", "*/Adam*")
    assert result.exit_code == 0, result.output
    assert "skipped 1 entry of no plain array (text, or TF's quantized types): 'tag'" in result.stderr
    loaded = ws.load(out)
    assert sorted(loaded) == ["dense/b", "dense/w", "emb", "stats"]
    reader = tf.train.load_checkpoint(made["tf1"])
    np.testing.assert_array_equal(loaded["dense/w"], reader.get_tensor("model/dense/w"))
    with ws.open(out) as opened:
        assert opened.metadata == {"source": made["tf1"], "source_kind": "TF1 checkpoint"}


def test_export_trainable_only(made, tmp_path):
    out = tmp_path / "t.h5"
    assert run("export", made["tf1"], "-o", out, "--trainable-only").exit_code == 0
    assert sorted(ws.load(out)) == ["model/dense/b", "model/dense/w", "model/emb"]
    result = run("export", made["tf1_nometa"], "-o", tmp_path / "n.npz", "--trainable-only")
    one_error_line(result, "model.ckpt-1.meta, which is missing")
    assert not (tmp_path / "n.npz").exists()


def test_export_tf2_checkpoint_without_optimizer_slots(made, tmp_path):
    out = tmp_path / "net.npz"
    result = run("export", made["module"] + ".index", "-o", out, "--scope", "net", "--exclude", "*/.OPTIMIZER_SLOT/*")
    assert result.exit_code == 0, result.output
    loaded = ws.load(out)
    assert sorted(loaded) == ["b", "w"]
    np.testing.assert_array_equal(loaded["w"], made["net"]["net/w"])


@pytest.mark.parametrize(("name", "scope", "kernel", "bias"), [("model.weights.h5", "layers/dense", "vars/0", "vars/1"),
                                                              ("model.keras", "d1", "kernel", "bias")])
def test_export_keras_files(made, tmp_path, name, scope, kernel, bias):
    """A .weights.h5 records no layer names, a .keras archive's config does: it is keyed like its model."""
    out = tmp_path / "k.npz"
    result = run("export", made["root"] / name, "-o", out, "--scope", scope, "--compress")
    assert result.exit_code == 0, result.output
    loaded = ws.load(out)
    assert sorted(loaded) == sorted([kernel, bias])
    np.testing.assert_array_equal(loaded[kernel], made["model"].get_layer("d1").kernel.numpy())


def test_export_store_maps_then_selects(store, tmp_path):
    out = tmp_path / "s.npz"
    assert run("export", store, "-o", out, "--map", "dense=student", "--include", "student").exit_code == 0
    assert sorted(ws.load(out)) == ["student/b", "student/w"]
    with ws.open(out) as opened:
        assert opened.metadata == {"run": "a"}


def test_export_unknown_scope_suggests_a_close_match(made, tmp_path):
    result = run("export", made["tf1"], "-o", tmp_path / "x.npz", "--scope", "modle")
    one_error_line(result, "scope 'modle' matches no key", "did you mean 'model'?")


# -- import --------------------------------------------------------------------------------

def test_import_map_matching_no_key_shows_what_the_keys_look_like(made, tmp_path):
    """A Keras 3 ``.weights.h5`` keys ``layers/dense/vars/0``, not the model's layer names: a map
    written for those names matched nothing, and the error said no more, so the user could not
    write the map without ``ws ls``. With no close scope to suggest, it shows the first keys."""
    with ws.open(made["root"] / "model.weights.h5") as source:
        keys = list(source.keys())
    line = one_error_line(run("import", made["root"] / "model.weights.h5", "--into", tmp_path / "e.npz",
                              "--map", "d1=student"), "model.weights.h5: mapping d1=student matches no key")
    assert line.endswith(f"; its keys look like {keys[0]!r}, {keys[1]!r}, {keys[2]!r}, ..."), line
    assert not (tmp_path / "e.npz").exists()


def test_import_into_stores_creates_merges_and_refuses_collisions(store, tmp_path):
    target = tmp_path / "ensemble.npz"
    assert run("import", store, "--into", target, "--scope", "model_001").exit_code == 0
    assert run("import", store, "--into", target, "--scope", "model_002", "--include", "dense").exit_code == 0
    assert sorted(ws.load(target)) == ["model_001/dense/b", "model_001/dense/w", "model_001/head/w",
                                       "model_002/dense/b", "model_002/dense/w"]
    before = target.read_bytes()
    result = run("import", store, "--into", target, "--scope", "model_002")
    one_error_line(result, "already holds 2 of the imported keys", "'model_002/dense/w'", "--overwrite")
    assert target.read_bytes() == before
    ws.save(tmp_path / "new.npz", {"dense/w": np.full((2, 3), 9, np.float32)})
    assert run("import", tmp_path / "new.npz", "--into", target, "--scope", "model_002", "--overwrite").exit_code == 0
    np.testing.assert_array_equal(ws.load(target)["model_002/dense/w"], np.full((2, 3), 9))
    assert len(ws.load(target)) == 5


@pytest.mark.parametrize("written_by", ["safetensors", "weightstore"])
def test_import_into_a_safetensors_file_named_as_a_state_dict_keeps_its_names(tmp_path, written_by):
    """A fix merged into a PyTorch-named file leaves it loadable by ``load_state_dict``: the file's
    names stay ``features.0.weight``, not the keys ``features/0/weight`` they read as."""
    from safetensors.numpy import load_file, save_file

    target = tmp_path / "model.safetensors"
    weights = {"features.0.weight": np.ones((2, 2), np.float32), "features.0.bias": np.zeros(2, np.float32)}
    if written_by == "safetensors":
        save_file(weights, str(target))
    else:
        ws.save(target, {name.replace(".", "/"): value for name, value in weights.items()}, names="torch")
    ws.save(tmp_path / "fix.npz", {"features/0/bias": np.full(2, 5, np.float32)})
    assert run("import", tmp_path / "fix.npz", "--into", target, "--overwrite").exit_code == 0
    written = load_file(str(target))
    assert sorted(written) == ["features.0.bias", "features.0.weight"]
    np.testing.assert_array_equal(written["features.0.bias"], [5, 5])
    np.testing.assert_array_equal(written["features.0.weight"], np.ones((2, 2)))
    ws.save(tmp_path / "dotted.npz", {"block.1/weight": np.ones(3, np.float32)})
    before = target.read_bytes()
    one_error_line(run("import", tmp_path / "dotted.npz", "--into", target), "names its tensors as a PyTorch "
                   "state_dict does, and the imported key 'block.1/weight' has a '.' inside a segment",
                   "--map 'block.1=NEW'")
    assert target.read_bytes() == before
    # under a scope, the rule proposed is in the source's keys, which a mapping sees: it works as given
    ws.save(tmp_path / "raw.npz", {"0.bias": np.ones(2, np.float32)})
    one_error_line(run("import", tmp_path / "raw.npz", "--into", target, "--scope", "old"),
                   "the imported key 'old/0.bias' has a '.' inside a segment", "(--map '0.bias=NEW')")
    assert target.read_bytes() == before
    assert run("import", tmp_path / "raw.npz", "--into", target, "--scope", "old", "--map", "0.bias=NEW").exit_code == 0
    assert "old.NEW" in load_file(str(target))


@pytest.mark.parametrize("name, meant", [("w.npzz", "w.npz"), ("w.safetensor", "w.safetensors"),
                                         ("w.npy", "w.npz"), ("w.H55", "w.h5")])
def test_import_into_a_misspelt_store_suffix_is_refused_not_made_a_checkpoint(store, tmp_path, name, meant):
    before = sorted(tmp_path.iterdir())
    result = run("import", store, "--into", tmp_path / name)
    one_error_line(result, "is no store suffix", f"did you mean '{tmp_path / meant}'", "model.ckpt")
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("name, says", [("new/", "ends in '/', so it names no checkpoint"),
                                        ("w.pt", "not .pt files"), ("notes.txt", "not .txt files")])
def test_import_into_a_name_no_checkpoint_can_have_is_refused_before_writing(store, tmp_path, name, says):
    """A new name that is neither a store nor a usable checkpoint prefix: a trailing slash would
    make hidden ``.index``/``.data-*`` files nothing reads back (and a state file naming ""), and
    another kind of file's suffix is a mistake. Nothing is written, not even the state file."""
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "trained.ckpt"\n')
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    one_error_line(run("import", store, "--into", f"{tmp_path}/{name}"), says)
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in before)


def test_import_into_a_url_without_a_store_suffix_says_checkpoints_are_written_locally(store):
    """Found as a user: docs/formats.md says a new name without a store suffix is a TF checkpoint
    prefix; on object storage ws writes none, and the refusal asked only for a store suffix,
    as if a checkpoint there were no choice. Refused before any request, by the real ws."""
    done = subprocess.run([sys.executable, "-m", "weightstore", "import", str(store), "--into",
                           "s3://bucket/run/model.ckpt", "--scope", "m"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: s3://bucket/run/model.ckpt: a TF checkpoint is written only to a local")
    assert ".npz" in done.stderr


@pytest.mark.parametrize("name", ["m.pt", "notes.TXT"])
def test_import_into_a_url_of_a_kind_of_file_ws_never_writes_says_so_as_a_local_name_does(store, tmp_path, name):
    """``--into s3://bucket/m.pt`` was answered that checkpoints are written only locally, while
    a local ``m.pt`` was told ws does not write ``.pt`` files: the URL gets the local answer,
    before any request."""
    local = run("import", store, "--into", tmp_path / name)
    done = subprocess.run([sys.executable, "-m", "weightstore", "import", str(store), "--into", f"s3://bucket/{name}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr == f"error: s3://bucket/{name}: {local.stderr.split(': ', 2)[2]}"


def test_import_into_tf_checkpoints_keeps_their_files_permissions(store, tmp_path):
    import stat

    prefix = tmp_path / "ens.ckpt"
    assert run("import", store, "--into", prefix, "--scope", "model_001").exit_code == 0
    module = tf.Module()
    module.w = tf.Variable(tf.zeros([2, 3]))
    object_based = tf.train.Checkpoint(model=module).write(str(tmp_path / "tf2" / "ckpt-1"))
    ws.save(tmp_path / "w.npz", {"model/w": np.ones((2, 3), np.float32)})
    targets = {prefix: [store, "--scope", "model_002"], object_based: [tmp_path / "w.npz", "--overwrite"]}
    for target, (source, *options) in targets.items():
        files = [path for path in Path(target).parent.iterdir() if path.name.startswith(Path(target).name + ".")]
        for path in files:
            os.chmod(path, 0o600)
        assert run("import", source, "--into", target, *options).exit_code == 0
        files = [path for path in Path(target).parent.iterdir() if path.name.startswith(Path(target).name + ".")]
        assert files and {stat.S_IMODE(os.stat(path).st_mode) for path in files} == {0o600}, target


@pytest.mark.parametrize("into", ["out/./m.ckpt", "new/../run/m.ckpt"])
def test_import_into_a_new_checkpoint_folder_named_with_dot_steps_makes_it(store, tmp_path, into):
    """``--into out/./m.ckpt`` (a script's ``$DIR/./m.ckpt``) made its folder as ``os.makedirs``
    does; making each missing folder in turn then tried to make ``out/.`` too, and failed
    with "File exists"."""
    prefix = f"{tmp_path}/{into}"  # a str: pathlib drops a "." step
    assert run("import", store, "--into", prefix).exit_code == 0
    assert set(tf.train.load_checkpoint(prefix).get_variable_to_shape_map()) == set(ws.load(store))


def test_import_into_a_new_folder_another_import_makes_meanwhile_writes_into_it(store, tmp_path, monkeypatch):
    """Two imports into one new folder at once (``run/a/m1.ckpt``, ``run/a/m2.ckpt``): the other
    makes ``run/a`` between this one's look and its ``mkdir``, made here to happen every time.
    The import writes into it, as ``os.makedirs`` let it; its ``mkdir`` failed "File exists"."""
    real_mkdir = os.mkdir

    def mkdir_after_another(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)  # the other import, just before
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(transfer.os, "mkdir", mkdir_after_another)
    prefix = f"{tmp_path}/run/a/m1.ckpt"
    assert run("import", store, "--into", prefix).exit_code == 0
    assert set(tf.train.load_checkpoint(prefix).get_variable_to_shape_map()) == set(ws.load(store))


def test_import_into_a_tf_checkpoint_restored_by_saver(store, tmp_path):
    prefix = str(tmp_path / "ens.ckpt")
    assert run("import", store, "--into", prefix, "--scope", "model_001").exit_code == 0
    result = run("import", store, "--into", prefix, "--scope", "model_002", "--map", "dense=student")
    assert result.exit_code == 0, result.output
    assert "into TF checkpoint" in result.stderr
    weights = ws.load(store)
    expected = {f"model_001/{k}": v for k, v in weights.items()}
    expected |= {f"model_002/{k.replace('dense', 'student')}": v for k, v in weights.items()}
    assert set(tf.train.load_checkpoint(prefix).get_variable_to_shape_map()) == set(expected)
    restored = restore_with_saver(prefix, {k: v.shape for k, v in expected.items()})
    for key, value in expected.items():
        np.testing.assert_array_equal(restored[key], value)
    before = Path(prefix + ".index").read_bytes()
    one_error_line(run("import", store, "--into", prefix, "--scope", "model_001"), "ens.ckpt: already holds 3")
    assert Path(prefix + ".index").read_bytes() == before
    for changed in ({"dense/w": np.zeros((3, 2), np.float32)}, {"dense/w": np.zeros((2, 3), np.float64)}):
        ws.save(tmp_path / "changed.npz", changed)  # --overwrite replaces values, never an entry's shape or dtype
        one_error_line(run("import", tmp_path / "changed.npz", "--into", prefix, "--scope", "model_001",
                           "--overwrite"), "tensor 'model_001/dense/w': is float32 [2, 3] in the checkpoint")
        assert Path(prefix + ".index").read_bytes() == before
    ws.save(tmp_path / "changed.npz", {"dense/w": np.full((2, 3), 5, np.float32)})
    assert run("import", tmp_path / "changed.npz", "--into", prefix, "--scope", "model_001", "--overwrite").exit_code == 0
    np.testing.assert_array_equal(restore_with_saver(prefix, {"model_001/dense/w": (2, 3)})["model_001/dense/w"],
                                  np.full((2, 3), 5))


# -- ls, diff, convert, verify ----------------------------------------------------------------

def test_ls_table_json_and_scope(store):
    result = run("ls", store)
    assert result.exit_code == 0
    assert "dense/w" in result.stdout and "3 tensors" in result.stdout and "run: a" in result.stdout
    document = json.loads(run("ls", store, "--json", "--scope", "dense").stdout)
    assert [t["key"] for t in document["tensors"]] == ["dense/w", "dense/b"]
    assert document["nbytes"] == 36 and document["metadata"] == {"run": "a"}
    one_error_line(run("ls", store, "--scope", "dens"), "did you mean 'dense'?")


def test_ls_of_many_tensors_lists_every_key_as_plain_columns(tmp_path):
    """Laying 10,000 rows out as a table took seconds; so many are printed as plain aligned lines,
    one a tensor, every key whole, with the totals; a file of fewer keeps its table."""
    keys = [f"layer_{i // 10}/block_{i % 10}/\u5c64kernel" for i in range(10_000)]  # wide characters: columns by cells
    path = tmp_path / "big.npz"
    ws.save(path, {key: np.zeros((i % 3, 2), np.float16) for i, key in enumerate(keys)}, metadata={"run": "a"})
    result = run("ls", path)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"{path} (weightstore file)" and lines[-1] == "run: a"
    header, rows, totals = lines[1], lines[2:-2], lines[-2]
    assert header.split() == ["key", "dtype", "shape", "size"]
    assert [row.split("  ")[0].rstrip() for row in rows] == keys
    assert rows[4].split() == [keys[4], "float16", "(1,", "2)", "4", "B"]
    assert {cell_len(row) for row in [header, *rows, totals]} == {len(header)}
    assert totals.split() == ["10000", "tensors", "39.1", "KiB"]
    ws.save(path, {key: np.zeros(2, np.float16) for key in keys[:render.TABLE_ROWS]})
    assert "┃ key" in run("ls", path).stdout


def test_ls_shows_metadata_a_terminal_would_act_on_escaped_and_keys_unfolded_when_piped(tmp_path):
    """A file's metadata reached the terminal with its escape sequences (clear screen, a
    window title); and piped, long keys folded at 80 columns, where grep missed them."""
    from safetensors.numpy import save_file

    path = tmp_path / "m.safetensors"
    key = "model/_functional/_operations/1/batch_normalization/moving_variance"
    save_file({key: np.ones(2, np.float32)}, str(path), metadata={"note\x1b[2J": "hi\x1b]0;TITLE\x07 \u202eevil"})
    result = run("ls", path)
    assert result.exit_code == 0 and "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert "note\\x1b[2J: hi\\x1b]0;TITLE\\x07 \\u202eevil" in result.stdout
    assert key in result.stdout
    named = tmp_path / "m\x1b[2J.safetensors"  # a path is text from the file system, shown the same way
    path.rename(named)
    result = run("ls", named)
    assert result.exit_code == 0 and "\x1b" not in result.stdout and "m\\x1b[2J.safetensors" in result.stdout


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_ls_lists_a_foreign_file_with_strings_beside_its_weights(tmp_path, suffix):
    """A tool's notes beside the weights (np.savez of a str array, an h5py text dataset) made ws ls
    refuse the whole file; they are listed as skipped instead, and loading still refuses them."""
    import h5py

    path = tmp_path / f"foreign{suffix}"
    if suffix == ".npz":
        np.savez(path, w=np.ones(3, np.float32), names=np.array(["a", "bc"]))
    else:
        with h5py.File(path, "w") as f:
            f["w"] = np.ones(3, np.float32)
            f["meta/names"] = np.array([b"a", b"bc"], dtype=h5py.string_dtype())
    text = "names" if suffix == ".npz" else "meta/names"
    result = run("ls", path)
    assert result.exit_code == 0, result.stderr
    assert "1 tensor" in result.stdout and f"skipped 1 entry of no plain array (text, or TF's quantized types): '{text}'" in result.stderr
    document = json.loads(run("ls", path, "--json").stdout)
    assert [t["key"] for t in document["tensors"]] == ["w"] and document["skipped"] == [text]
    with pytest.raises((ws.UnsupportedDTypeError, ws.UnsafeFileError), match=text):
        ws.load(path)


@pytest.mark.parametrize("command", ["convert", "export", "convert to npz"])
def test_a_state_dicts_file_converted_or_exported_keeps_its_names(tmp_path, command):
    """Merging an HF model.safetensors (or a shard folder) into one safetensors file renamed
    every tensor from features.0.weight to features/0/weight, with exit 0, and load_state_dict
    failed."""
    from safetensors.numpy import load_file, save_file

    source = tmp_path / "model.safetensors"
    state = {"features.0.weight": np.ones((2, 3), np.float32), "features.0.bias": np.zeros(2, np.float32)}
    save_file(state, str(source), metadata={"format": "pt"})
    out = tmp_path / ("out.npz" if command == "convert to npz" else "out.safetensors")
    words = ["export", source, "-o", out] if command == "export" else ["convert", source, out]
    assert run(*words).exit_code == 0
    if out.suffix == ".npz":  # there the names would be the keys: keys, which scopes select, stay
        assert sorted(ws.load(out)) == ["features/0/bias", "features/0/weight"]
    else:
        assert sorted(load_file(str(out))) == sorted(state)
    assert run("convert", source, tmp_path / "keys.safetensors", "--names", "keys").exit_code == 0
    assert sorted(load_file(str(tmp_path / "keys.safetensors"))) == ["features/0/bias", "features/0/weight"]
    mapped = tmp_path / "mapped.safetensors"  # a key no state_dict name spells: written as a key
    assert run("export", source, "-o", mapped, "--map", "features=feat.x").exit_code == 0
    assert sorted(load_file(str(mapped))) == ["feat.x/0/bias", "feat.x/0/weight"]


def test_import_into_a_hugging_face_folder_says_what_to_do(tmp_path):
    """The plain folder's advice (a checkpoint prefix inside it) made a TF checkpoint nothing
    transformers reads; the index's path was called "not a weightstore file"."""
    from safetensors.numpy import save_file

    patch = tmp_path / "patch.npz"
    ws.save(patch, {"0/bias": np.zeros(2, np.float32)})
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    save_file({"0.weight": np.ones((2, 3), np.float32), "0.bias": np.ones(2, np.float32)}, str(single / "model.safetensors"),
              metadata={"format": "pt"})
    ws.save(sharded, {"0/weight": np.ones((2, 3), np.float32), "0/bias": np.ones(2, np.float32)}, max_shard_size="30B")
    one_error_line(run("import", patch, "--into", single, "--overwrite"), "Hugging Face folder",
                   f"--into {single / 'model.safetensors'}")
    for target in (sharded, sharded / "model.safetensors.index.json"):
        one_error_line(run("import", patch, "--into", target, "--overwrite"), "sharded Hugging Face folder",
                       "--max-shard-size")
    assert sorted(os.listdir(single)) == ["model.safetensors"]
    assert run("import", patch, "--into", single / "model.safetensors", "--overwrite").exit_code == 0
    np.testing.assert_array_equal(ws.load(single)["0/bias"], np.zeros(2))


def test_a_symlink_loop_is_named_as_such_not_as_a_missing_file(tmp_path):
    loop = tmp_path / "loop.npz"
    loop.symlink_to(loop)
    one_error_line(run("ls", loop), "loop.npz: cannot be opened (Too many levels of symbolic links)")


def test_ls_scope_lists_the_key_equal_to_the_scope(tmp_path):
    path = tmp_path / "slots.npz"
    ws.save(path, {"w": np.ones(2, np.float32), "w/Adagrad": np.ones(2, np.float32), "wx": np.ones(1, np.float32)})
    document = json.loads(run("ls", path, "--json", "--scope", "w").stdout)
    assert [t["key"] for t in document["tensors"]] == ["w", "w/Adagrad"] and document["count"] == 2
    assert "w/Adagrad" in run("ls", path, "--scope", "w/").stdout
    one_error_line(run("ls", path, "--scope", "w/Adgrad"), "scope 'w/Adgrad' matches no key", "did you mean 'w/Adagrad'?")


def test_ls_scope_with_include_or_exclude_keeps_what_load_keeps_and_the_scope_key(tmp_path):
    """An exclude that named none of them dropped TF1's ``w`` (the scope's own key) beside its slots.
    Under the scope, the real ``ws ls`` lists exactly what ``ws.load`` selects; the scope's own key,
    which no pattern relative to the scope can name, stays unless --include asks for named keys only."""
    path = tmp_path / "slots.npz"
    ws.save(path, {key: np.ones(2, np.float32) for key in ("w", "w/Adam", "w/Adam_1", "wx")})

    cases = [(("-x", "*_1"), {"exclude": "*_1"}), (("-x", "Adam"), {"exclude": "Adam"}),
             (("-i", "Adam*"), {"include": "Adam*"}), ((), {})]
    runs = ws_in_turn([["ls", path, "--json", "--scope", "w", *words] for words, _ in cases])
    for (words, selection), (status, stdout, stderr) in zip(cases, runs, strict=True):
        assert status == 0, stderr
        under = sorted("w/" + key for key in ws.load(path, scope="w", **selection))
        listed = [t["key"] for t in json.loads(stdout)["tensors"]]
        assert listed == (["w"] if "include" not in selection else []) + under, words


def test_ls_scope_naming_a_tensor_alone_with_include_is_refused_as_export_refuses_it(tmp_path):
    """``ws ls --scope w --include 'x*'`` where ``w`` is a tensor with nothing under it listed
    nothing and exited 0, as if the file held nothing; ``ws export`` says ``w`` is a tensor, not a
    scope, and so does ``ls``. Without --include the scope's own key is listed, as without words."""
    path = tmp_path / "plain.npz"
    ws.save(path, {"w": np.ones(2, np.float32), "wx": np.ones(2, np.float32)})
    for command in (["ls", path], ["export", path, "-o", tmp_path / "out.npz"]):
        one_error_line(run(*command, "--scope", "w", "--include", "x*"), "scope 'w' matches no key",
                       "'w' is a tensor, not a scope")
    assert [t["key"] for t in json.loads(run("ls", path, "--json", "--scope", "w", "-x", "x*").stdout)["tensors"]] == ["w"]
    ws.save(tmp_path / "empty.npz", {})  # a file of no tensors lists none, whatever the words
    for words in (["--include", "x*"], ["--scope", "w", "--include", "x*"]):
        assert json.loads(run("ls", tmp_path / "empty.npz", "--json", *words).stdout)["count"] == 0


def test_ls_selects_with_include_and_exclude_as_export_does(store, tmp_path):
    """``ws export`` took --include/--exclude and ``ws ls`` did not: the keys a selection keeps
    could not be listed before writing them. The real ``ws``, relative to --scope as export's."""
    def listed(*args):
        done = subprocess.run([sys.executable, "-m", "weightstore", "ls", str(store), "--json", *args],
                              capture_output=True, text=True, timeout=120)
        return done.returncode, json.loads(done.stdout)

    code, document = listed("--include", "*/w", "--exclude", "head/*")
    assert code == 0 and [t["key"] for t in document["tensors"]] == ["dense/w"] and document["count"] == 1
    code, document = listed("--scope", "dense", "-x", "b")
    assert code == 0 and [t["key"] for t in document["tensors"]] == ["dense/w"]
    assert run("export", store, "-o", tmp_path / "o.npz", "--scope", "dense", "-x", "b").exit_code == 0
    assert sorted(ws.load(tmp_path / "o.npz")) == ["w"]  # the same selection export writes, keyed without the scope
    code, document = listed("--include", "dense/ww")
    assert code == 1 and "include 'dense/ww' matches no key" in document["error"]["message"]
    assert document["error"]["path"] == str(store)


@pytest.mark.parametrize("scope", ["dens", "nope", "/dense", "dense//w"])
def test_ls_refuses_a_scope_as_export_does(store, tmp_path, scope):
    """The same error, naming the file, with the same closest-key hint, whichever command is asked."""
    listed = run("ls", store, "--scope", scope, "--json")
    exported = run("export", store, "-o", tmp_path / "o.npz", "--scope", scope, "--json")
    line = one_error_line(listed, f"error: {store}: ", *(["did you mean 'dense'?"] if scope == "dens" else []))
    assert line == one_error_line(exported)
    error = json.loads(listed.stdout)["error"]
    assert error == json.loads(exported.stdout)["error"] and error["path"] == str(store)


def test_a_trailing_slash_names_the_same_scope_and_a_leading_one_is_refused(store, tmp_path):
    """Users type ``dense/``; every command reads it as ``dense``. ``/dense`` is refused alike with the fix."""
    for scope in ("dense", "dense/"):
        listed = json.loads(run("ls", store, "--json", "--scope", scope).stdout)
        assert [t["key"] for t in listed["tensors"]] == ["dense/w", "dense/b"], scope
        out, into = tmp_path / f"e{len(scope)}.npz", tmp_path / f"i{len(scope)}.npz"
        assert run("export", store, "-o", out, "--scope", scope).exit_code == 0
        assert sorted(ws.load(out)) == ["b", "w"]
        assert run("import", store, "--into", into, "--scope", scope).exit_code == 0
        assert sorted(ws.load(into)) == ["dense/dense/b", "dense/dense/w", "dense/head/w"]
    for args in (["ls", store], ["export", store, "-o", tmp_path / "x.npz"], ["import", store, "--into", tmp_path / "y.npz"]):
        one_error_line(run(*args, "--scope", "/dense"), "invalid scope '/dense': it starts with '/'", "write 'dense'")
    assert not (tmp_path / "x.npz").exists() and not (tmp_path / "y.npz").exists()


def test_ls_reads_checkpoints_too(made):
    result = run("ls", made["tf1"], "--json")
    assert result.exit_code == 0
    assert {t["key"] for t in json.loads(result.stdout)["tensors"]} >= {"model/dense/w", "global_step"}


def test_diff_exit_status_and_report(store, tmp_path):
    assert run("diff", store, store).exit_code == 0
    other = tmp_path / "other.h5"
    weights = ws.load(store)
    weights["dense/w"] = weights["dense/w"] + np.float32(0.5)
    weights["head/w"] = np.zeros((1, 3), np.float32)
    weights["extra"] = np.ones(1)
    del weights["dense/b"]
    ws.save(other, weights)
    result = run("diff", store, other, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["added"] == ["extra"] and report["removed"] == ["dense/b"] and not report["equal"]
    changes = {c["key"]: c for c in report["changed"]}
    assert changes["dense/w"]["max_abs"] == 0.5 and changes["dense/w"]["max_rel"] == pytest.approx(0.1)
    assert changes["head/w"]["reason"] == "shape"
    text = run("diff", store, other, "--atol", "1")
    assert text.exit_code == 1 and "~ head/w  shape: float32[3, 1] -> float32[1, 3]" in text.stdout
    assert "1 added, 1 removed, 1 changed, 1 unchanged; metadata differs" in text.stdout  # dense/w within atol


@pytest.mark.parametrize("dtype, left, right", [
    ("int64", 2**53, 2**53 + 1),  # one number in float64
    ("uint64", 2**63 + 4, 2**63 + 5),
    ("int64", -2**63, 2**63 - 1),  # a gap past int64's range
])
def test_diff_tells_integers_apart_by_one_however_large(tmp_path, dtype, left, right):
    ws.save(tmp_path / "a.npz", {"x": np.array([left, 7], dtype)})
    ws.save(tmp_path / "b.npz", {"x": np.array([right, 7], dtype)})
    result = run("diff", tmp_path / "a.npz", tmp_path / "b.npz", "--atol", "0.5", "--json")
    assert result.exit_code == 1, result.output
    change = json.loads(result.stdout)["changed"][0]
    assert change["key"] == "x" and change["max_abs"] == float(abs(right - left))


def test_diff_says_which_pairs_only_their_recorded_digests_called_equal_and_reads_them_when_asked(tmp_path):
    """A copy damaged after it was written still carries the digest of what was written: diff
    must not present that as having compared the bytes."""
    weights = {"k": np.arange(1000, dtype=np.float32), "j": np.ones(4, np.float32)}
    ws.save(tmp_path / "a.npz", weights, digests=True)
    ws.save(tmp_path / "b.npz", weights, digests=True)
    raw = bytearray((tmp_path / "b.npz").read_bytes())
    at = raw.index(np.arange(1000, dtype=np.float32).tobytes())
    raw[at + 2000:at + 2004] = np.float32(-1e30).tobytes()
    (tmp_path / "b.npz").write_bytes(bytes(raw))
    quick = run("diff", tmp_path / "a.npz", tmp_path / "b.npz")
    assert quick.exit_code == 0 and "2 unchanged (2 by their recorded digests, not read; --read reads them)" in quick.stdout
    assert json.loads(run("diff", tmp_path / "a.npz", tmp_path / "b.npz", "--json").stdout)["unchanged_by_digest"] == 2
    one_error_line(run("diff", tmp_path / "a.npz", tmp_path / "b.npz", "--read"), "b.npz", "'k'", "checksum", status=2)


def test_diff_and_verify_tell_a_failure_from_their_answer_as_diff_and_cmp_do(tmp_path):
    """``ws diff corrupt.npz ok.npz`` exited 1, as two files that differ do: a script could not
    tell them apart. 0 same or intact, 1 different or corrupt, 2 when it cannot tell."""
    ok, other, absent = tmp_path / "ok.npz", tmp_path / "other.npz", tmp_path / "absent.npz"
    ws.save(ok, {"w": np.arange(8, dtype=np.float32)})
    ws.save(other, {"w": np.zeros(8, np.float32)})
    truncated, flipped = tmp_path / "truncated.npz", tmp_path / "flipped.npz"
    truncated.write_bytes(ok.read_bytes()[:-40])
    raw = bytearray(ok.read_bytes())
    raw[raw.index(np.arange(8, dtype=np.float32).tobytes()) + 4] ^= 1
    flipped.write_bytes(bytes(raw))
    expected = [(["diff", ok, ok], 0), (["diff", ok, other], 1), (["diff", truncated, ok], 2),
                (["diff", ok, flipped], 2), (["diff", ok, absent], 2), (["diff", ok, ok, "--atol", "-1"], 2),
                (["verify", ok], 0), (["verify", truncated], 1), (["verify", flipped], 1), (["verify", absent], 2)]
    for (args, status), (returned, _, stderr) in zip(expected, ws_in_turn([args for args, _ in expected]), strict=True):
        assert returned == status and "Traceback" not in stderr, (args, stderr)


def test_diff_values_nan_and_infinity_rules():
    from weightstore.cli.compare import difference

    inf, nan = np.inf, np.nan
    assert difference(np.array([1.0, nan, inf]), np.array([1.0, nan, inf])) == (0.0, 0.0)  # NaN = NaN, inf = inf
    assert difference(np.array([2.0, 4.0]), np.array([2.5, 4.0])) == (0.5, 0.125)
    assert difference(np.array([1.0, nan]), np.array([1.0, 2.0])) == (inf, inf)  # NaN against a number
    assert difference(np.array([inf, 1.0]), np.array([-inf, 1.0])) == (inf, inf)
    assert difference(np.array([nan, nan]), np.array([nan, 1.0])) == (inf, inf)  # max |x| of all-NaN is 0
    assert difference(np.array([1 + 1j]), np.array([1 + 2j])) == (1.0, 1 / np.sqrt(2))
    assert difference(np.array([True, False]), np.array([True, True])) == (1.0, 1.0)
    assert difference(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32)) == (0.0, 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_diff_in_slices_equals_diff_in_one_piece(seed):
    from weightstore.cli.compare import difference

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(37, 5)).astype(np.float32)
    y = x.copy()
    specials = [np.nan, np.inf, -np.inf, 0.0, 1e30]
    for array in (x, y):
        for _ in range(8):
            array.flat[rng.integers(x.size)] = specials[rng.integers(len(specials))]
    x[:2] = np.nan  # a slice that is all NaN in x
    y.flat[rng.integers(x.size)] += np.float32(seed)
    whole = difference(x, y, chunk=x.size)
    for chunk in (1, 3, 7, 64):
        assert difference(x, y, chunk=chunk) == whole


def test_diff_memory_stays_near_the_two_tensors():
    import tracemalloc

    from weightstore.cli.compare import difference

    x = np.arange(16 << 20, dtype=np.float32)  # 64 MiB each; float64 copies of both would be 256 MiB
    y = x.copy()
    y[-1] += 1
    tracemalloc.start()
    try:
        assert difference(x, y) == (1.0, 1.0 / float(x[-1]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 << 20, peak


def test_diff_of_an_export_against_its_checkpoint(made, tmp_path):
    out = tmp_path / "all.npz"
    assert run("export", made["tf1"], "-o", out).exit_code == 0
    assert run("diff", made["tf1"], out).exit_code == 0


def test_convert_keeps_metadata_and_values(store, tmp_path):
    h5 = tmp_path / "m.h5"
    assert run("convert", store, h5).exit_code == 0
    assert run("convert", h5, tmp_path / "back.npz", "--compress").exit_code == 0
    for path in (h5, tmp_path / "back.npz"):
        with ws.open(path) as opened:
            assert opened.metadata == {"run": "a"}
        assert run("diff", store, path).exit_code == 0


def _corrupt_members(store: Path, *keys: str) -> None:
    """Flip the first data byte of each of these tensors of an npz store."""
    data = bytearray(store.read_bytes())
    for key in keys:
        member = data.index(f"{key}.npy".encode())
        data[data.index(b"\n", data.index(b"\x93NUMPY", member)) + 1] ^= 0xFF
    store.write_bytes(bytes(data))


def test_verify_names_the_corrupt_tensor(store, tmp_path):
    result = run("verify", store)
    assert result.exit_code == 0 and "ok, 3 tensors" in result.stderr
    _corrupt_members(store, "dense/b")
    one_error_line(run("verify", store), f"{store}: tensor 'dense/b': is corrupt", "(1 of 3 tensors corrupt)")
    error = json.loads(run("verify", store, "--json").stdout)["error"]
    assert (error["type"], error["path"], error["key"], error["keys"]) == ("ChecksumError", str(store), "dense/b",
                                                                           ["dense/b"])


def test_verify_of_a_tf_checkpoint_says_its_own_checksums_were_checked(store, tmp_path):
    """A TF checkpoint's tensors carry TF's CRC-32C, which verify checks (a flipped byte exits 1
    naming the tensor): an intact one said "no checksums to check", as if nothing had been."""
    prefix = tmp_path / "ens.ckpt"
    assert run("import", store, "--into", prefix, "--scope", "model_001").exit_code == 0
    result = run("verify", prefix)
    assert result.exit_code == 0 and "no checksums" not in result.stderr
    assert f"{prefix}: ok, 3 tensors, TF's CRC-32C checksums match" in result.stderr
    assert json.loads(run("verify", prefix, "--json").stdout)["checksums"] is True
    data = Path(f"{prefix}.data-00000-of-00001")
    contents = bytearray(data.read_bytes())
    contents[0] ^= 0xFF  # the first tensor the data file holds
    data.write_bytes(bytes(contents))
    one_error_line(run("verify", prefix), "tensor 'model_001/", "is corrupt (CRC-32C", "(1 of 3 tensors corrupt)")


def test_verify_json_lists_every_corrupt_tensor(store):
    """Scripts read the corrupt keys from ``error.keys``; ``key`` stays null when several are at fault."""
    _corrupt_members(store, "dense/b", "head/w")
    result = run("verify", store, "--json")
    error = json.loads(result.stdout)["error"]
    assert (error["path"], error["key"], error["keys"]) == (str(store), None, ["dense/b", "head/w"])
    one_error_line(result, "2 of 3 tensors corrupt: tensor 'dense/b': is corrupt", "; tensor 'head/w': is corrupt")


def test_verify_shows_a_long_key_once_by_its_ends(tmp_path):
    """A key of hundreds of characters is shown shortened, once, in the list of corrupt tensors."""
    long_key = "k" * 250
    path = tmp_path / "v.npz"
    ws.save(path, {long_key: np.arange(64, dtype=np.float32), "short": np.arange(64, dtype=np.float32)})
    _corrupt_members(path, long_key, "short")
    line = one_error_line(run("verify", path), "2 of 2 tensors corrupt: tensors 'kkk",
                          "(250 characters), 'short': is corrupt")  # alike (the same bytes): said once
    assert long_key not in line and line.count("(250 characters)") == 1


# -- errors --------------------------------------------------------------------------------

def test_missing_and_junk_files(tmp_path):
    one_error_line(run("ls", tmp_path / "absent.npz"), "absent.npz: no such file")
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    one_error_line(run("verify", tmp_path / "junk.npz"), "junk.npz")
    (tmp_path / "junk").write_bytes(b"\x00" * 64)
    one_error_line(run("export", tmp_path / "junk", "-o", tmp_path / "o.npz"), "junk: not a weightstore file")


def test_a_file_under_another_formats_suffix_says_so_and_how_to_read_it(store, tmp_path):
    """A safetensors file saved or downloaded as ``model.npz`` was "not an npz file (no zip
    directory; truncated or not a zip)", as if damaged. Its first bytes tell: the error says
    which format they are and what to do; read so, the values are the file's."""
    weights = ws.load(store)
    cases = [(".safetensors", ".npz"), (".npz", ".safetensors"), (".safetensors", ".h5")]
    for real, named in cases:
        ws.save(tmp_path / f"real{real}", weights)
        shutil.copyfile(tmp_path / f"real{real}", tmp_path / f"wrong{named}")
    commands = [[command, tmp_path / f"wrong{named}", *rest] for _, named in cases
                for command, *rest in (["ls"], ["convert", tmp_path / "out.npz"])]
    runs = iter(ws_in_turn(commands))
    for real, named in cases:
        wrong, fmt = tmp_path / f"wrong{named}", real.lstrip(".")
        for _ in ("ls", "convert"):
            assert next(runs) == (1, "", (
                f"error: {wrong}: its name says {'hdf5' if named == '.h5' else named.lstrip('.')}, but its first "
                f"bytes say {fmt}: rename it to end in {real} (or read it with ws.open(path, format={fmt!r}))\n"))
        with ws.open(wrong, format=fmt) as opened:
            assert {key: opened[key].tolist() for key in opened} == {k: v.tolist() for k, v in weights.items()}
    assert not (tmp_path / "out.npz").exists()
    (tmp_path / "cut.npz").write_bytes((tmp_path / "real.npz").read_bytes()[:200])  # its own format, cut short
    one_error_line(run("ls", tmp_path / "cut.npz"), "cut.npz: not an npz file (no zip directory; truncated")


def test_a_name_with_a_newline_or_an_escape_is_shown_escaped_in_notes_and_errors(store, tmp_path):
    """``ws ls`` showed ``new\\nline.npz``; an error cut that name into two parts of its line
    (``absent; x.npz``, as if two things), and the "wrote" note printed it raw: over two lines,
    and a name holding ESC ran its terminal commands. Both show it as ``ws ls`` does."""
    newline, escape = tmp_path / "o\nut.h5", tmp_path / "\x1b[31mred.npz"
    done = subprocess.run([WS, "convert", str(store), str(newline)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, f"wrote 3 tensors (48 B) to {tmp_path}/o\\nut.h5\n")
    assert ws.load(newline).keys() == ws.load(store).keys()
    for absent, shown in ((tmp_path / "absent\nx.npz", "absent\\nx.npz"), (escape, "\\x1b[31mred.npz")):
        done = subprocess.run([WS, "ls", str(absent)], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stderr) == (1, f"error: {tmp_path}/{shown}: no such file or checkpoint\n")
    done = subprocess.run([WS, "ls", "--json", str(escape)], capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout)["error"]["path"] == str(escape)  # a script gets the name as it is


def test_a_folder_of_versions_given_as_a_file_names_its_latest_version(store, tmp_path):
    """``ws versions run`` then ``ws ls run``: the refusal says what the folder is and which file to give
    (never LATEST's where a symbolic link holds its name: what holds it is said instead; nor where
    its file was removed)."""
    run_folder = tmp_path / "run"
    for step in (1, 2):
        ws.publish(run_folder, ws.load(store), step=step)
    latest = ws.latest(run_folder).path
    for args in (["ls", run_folder], ["export", run_folder, "-o", tmp_path / "o.npz"]):
        one_error_line(run(*args), "run: is a folder of ws.publish versions", f"such as LATEST's {latest}")
    assert not (tmp_path / "o.npz").exists()
    assert run("verify", run_folder).exit_code == 0  # every version (tests/test_verify_folder.py)
    with pytest.raises(ws.StoreNotFoundError, match="folder of ws.publish versions"):
        ws.load(run_folder)
    assert run("ls", latest).exit_code == 0
    os.rename(latest, tmp_path / "moved.npz")
    os.symlink(tmp_path / "moved.npz", latest)  # LATEST's name held by a link, which no reader of versions opens
    said = one_error_line(run("ls", run_folder), f"LATEST's {latest} is a symbolic link", "put the file itself")
    assert "such as" not in said and "ws.latest" not in said
    os.remove(latest)  # removed by hand: a step-* file is suggested, not LATEST's, which is no more
    said = one_error_line(run("ls", run_folder), "run: is a folder of ws.publish versions", "one of its step-* files")
    assert "such as" not in said
    os.remove(run_folder / "LATEST")
    os.mkfifo(run_folder / "LATEST")  # a hostile folder: never opened, and still named for what it is
    one_error_line(run("ls", run_folder), "run: is a folder of ws.publish versions", "one of its step-* files")
    verified = run("verify", run_folder)  # LATEST is what is wrong with the folder
    assert verified.exit_code == 1 and "LATEST is a FIFO" in verified.stdout, verified.output


def test_a_folders_latest_given_as_a_file_names_the_version_it_points_to(store, tmp_path):
    """``ws ls run/LATEST``, a new user's first try at the newest version: it said "not a
    weightstore file (not npz, HDF5 or safetensors)" of a file weightstore wrote. It names the
    version LATEST points to (or, where the pointer is longer than the bytes looked at, where to
    look), in Python as in ``ws``. The other way, ``ws follow run/LATEST`` (or a version's file)
    names the folder to give."""
    run_folder = tmp_path / "run"
    ws.publish(run_folder, ws.load(store), step=3)
    latest = ws.latest(run_folder).path
    for args in (["ls", run_folder / "LATEST"], ["export", run_folder / "LATEST", "-o", tmp_path / "o.npz"]):
        one_error_line(run(*args), "run/LATEST: is a versioned folder's LATEST pointer, not a weight file",
                       f"it names {latest}, the version to read")
    one_error_line(run("diff", run_folder / "LATEST", store), "LATEST pointer", status=2)
    ws.publish(run_folder, ws.load(store), step=4, metadata={"note": "x" * 1000})
    with pytest.raises(ws.FormatError, match="LATEST pointer, not a weight file; name one of its step-"):
        ws.load(run_folder / "LATEST")
    for command in ("versions", "follow", "verify", "clean"):  # the other way: a folder's own file for the folder
        given = run_folder / ("LATEST" if command != "versions" else os.path.basename(latest))
        if command == "verify":  # verify reads a file as a weight file: the pointer's refusal above
            one_error_line(run(command, given), "LATEST pointer", status=1)
            continue
        one_error_line(run(command, given), "is a file, not a folder of versions; give the folder it is in, "
                                            f"{run_folder}")


def test_a_keras_zip_bomb_is_one_error_line(tmp_path):
    bomb = hostile_keras(tmp_path / "bomb.keras", b"\0" * (1 << 20), declared=0xF000_0000)
    one_error_line(run("ls", bomb), "bomb.keras: model.weights.h5 declares 4026531840 bytes", "zip bomb")
    assert sorted(os.listdir(tmp_path)) == ["bomb.keras"]


def test_debug_shows_the_exception(tmp_path):
    result = run("--debug", "ls", tmp_path / "absent.npz")
    assert isinstance(result.exception, ws.StoreNotFoundError)


def test_folder_commands_refuse_a_missing_folder_or_a_file(store, tmp_path):
    """A typo is not a clean folder ("removed 0", exit 0), and a store is not a folder of versions."""
    for command in ("versions", "follow", "clean"):
        one_error_line(run(command, tmp_path / "typo"), "typo: no such folder")
        one_error_line(run(command, store, "--timeout", "1") if command == "follow" else run(command, store),
                       "m.npz: is a file, not a folder of versions")
    assert not (tmp_path / "typo").exists()


def test_guard_covers_commands_from_other_modules(tmp_path):
    one_error_line(run("versions", tmp_path / "no-such-folder"), "no such folder")
    import typer

    extra = typer.Typer(cls=GuardedGroup)

    @extra.command()
    def fail(kind: str) -> None:
        raise PermissionError(13, "Permission denied", "/some/file") if kind == "os" else ZeroDivisionError("boom")

    @extra.command()
    def other() -> None: ...

    result = CliRunner().invoke(extra, ["fail", "os"])
    assert result.exit_code == 1 and result.stderr.strip() == "error: /some/file: Permission denied"
    result = CliRunner().invoke(extra, ["fail", "bug"])
    assert result.exit_code == 1 and "internal error (ZeroDivisionError: boom); run with --debug" in result.stderr


def test_a_write_refused_with_epipe_is_an_error_not_a_closed_output():
    """A closed pipe of the output ends ``ws`` quietly (exit 141); a write the file system refused
    with EPIPE (a FUSE mount's) is a weightstore error keeping that errno, and still one error line."""
    import errno

    import typer

    extra = typer.Typer(cls=GuardedGroup)

    @extra.command()
    def fail() -> None:
        raise ws.WriteError(errno.EPIPE, "writing failed: Broken pipe", path="/mnt/fuse/x.npz")

    @extra.command()
    def other() -> None: ...

    one_error_line(CliRunner().invoke(extra, ["fail"]), "/mnt/fuse/x.npz: writing failed: Broken pipe")


def test_progress_appears_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(render, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(render.settings, "quiet", False)
    for terminal in (True, False):
        buffer = io.StringIO()
        monkeypatch.setattr(render, "stderr",
                            lambda buffer=buffer, terminal=terminal: Console(file=buffer, force_terminal=terminal, width=80))
        assert list(render.track([("a", 10), ("b", 10)], "reading", 20)) == ["a", "b"]
        with render.working("writing"):
            time.sleep(0.05)
        assert ("reading" in buffer.getvalue()) is terminal


@pytest.mark.parametrize("command", [["convert", "{store}", "{out}.h5", "--compress"],
                                     ["export", "{store}", "-o", "{out}.npz", "--compress"],
                                     ["import", "{store}", "--into", "{out}.h5"]], ids=["convert", "export", "import"])
def test_writing_a_store_shows_the_byte_bar_reading_does(store, tmp_path, monkeypatch, command):
    """Compressing and HDF5 are where a write spends its time: it counts bytes as reading does, not a spinner."""
    monkeypatch.setattr(render, "PROGRESS_DELAY_S", 0.0)
    buffer = io.StringIO()
    monkeypatch.setattr(render, "stderr", lambda: Console(file=buffer, force_terminal=True, width=300))
    out = tmp_path / "out"
    result = run(*(part.format(store=store, out=out) for part in command))
    assert result.exit_code == 0, result.output
    shown = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buffer.getvalue())
    assert re.search(rf"writing {re.escape(str(out))}\.(h5|npz) [^\r\n]* 48/48 bytes", shown), shown


# -- the installed command -------------------------------------------------------------------

def test_installed_ws_exports_a_checkpoint_quietly(made, tmp_path):
    out = tmp_path / "x.npz"
    done = subprocess.run([WS, "export", made["tf1"], "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines() == [  # none of TensorFlow's start-up noise
        f"wrote {len(ws.load(out))} tensors (232 B) from TF1 checkpoint {made['tf1']} to {out}",
        "skipped 1 entry of no plain array (text, or TF's quantized types): 'tag'",
    ]
    done = subprocess.run([WS, "-q", "ls", str(tmp_path / "absent.npz")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr == f"error: {tmp_path / 'absent.npz'}: no such file or checkpoint\n"


def test_python_m_weightstore(store):
    done = subprocess.run([sys.executable, "-m", "weightstore", "ls", "--json", str(store)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["count"] == 3


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")
def test_ctrl_c_once_a_command_has_ended_ends_it_quietly_with_its_status(tmp_path):
    """Once a command has written its file and said so, Python's exit joins the threads faulting
    the file's next pieces in ahead of the reader (here each takes 10 s, as on a slow mount). A
    Ctrl-C there printed a traceback of the join; it ends the process at once, with the
    command's status, and the file it wrote stays whole."""
    script = """
import sys, threading, time
from weightstore.io import _local
_local._advice_piece = lambda device: None  # populate, whatever the device's read-ahead
real = _local.populate_read

def slow(address, length):
    if threading.current_thread().name.startswith("weightstore-populate"):
        time.sleep(10)
    return real(address, length)

_local.populate_read = slow
ended = sys.argv.pop()
sys.argv = ["ws", *sys.argv[1:]]
from _weightstore_cli import main
try:
    main()
finally:  # registered last, so the exit's first hook: it marks the exit's start, before the joins
    threading._register_atexit(lambda: open(ended, "x").close())
"""
    source, written, ended = tmp_path / "two.npz", tmp_path / "a.npz", tmp_path / "ended"
    ws.save(source, {"a": np.ones(2 << 20, np.float32), "b": np.zeros(16 << 20, np.float32)})
    started = subprocess.Popen([sys.executable, "-c", script, "export", str(source), "-o", str(written), "--include",
                                "a", str(ended)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    try:
        said = started.stderr.readline()
        assert said.startswith("wrote 1 tensor"), said + started.stderr.read()
        wait_until(lambda: ended.exists() or started.poll() is not None,
                   what="the command's end: Python's exit, waiting for the populators")
        started.send_signal(signal.SIGINT)
        out, err = started.communicate(timeout=60)
    finally:
        started.kill()
    assert (started.returncode, out, err) == (0, "", "")
    assert ws.load(written)["a"].tolist() == [1.0] * (2 << 20)


def test_ctrl_c_that_python_wraps_in_another_error_exits_130_quietly(tmp_path):
    """Python 3.11 turns a Ctrl-C that comes while a class is made (a ``cached_property``'s
    ``__set_name__``, as ``ws ls`` imports the store's modules) into a RuntimeError caused by it,
    which ``ws`` printed as an internal error, exit 1, where the Ctrl-C tests' timing hit it."""
    ws.save(tmp_path / "m.npz", {"w": np.zeros(2, np.float32)})
    script = """
import sys
from weightstore.cli import sources

def opened_while_a_class_was_made(*args, **kwargs):
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        raise RuntimeError("Error calling __set_name__ on 'cached_property' instance '_key_set' in 'Store'") from exc

sources.open_source = opened_while_a_class_was_made
sys.argv = ["ws", "ls", sys.argv[1]]
from _weightstore_cli import main
main()
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m.npz")], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "interrupted\n")


SWALLOWED_WHILE_FOLLOWING = """
import gc, os, signal, sys
from _weightstore_cli import main

def collected(phase, info):  # a callback whose exceptions Python only prints, as an import's lock's weak reference's
    if phase == "stop" and "weightstore.sync._follow" in sys.modules and not fired:
        fired.append(True)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs here: its KeyboardInterrupt is "ignored"
            pass

fired = []
gc.callbacks.append(collected)
sys.argv = ["ws", *sys.argv[1:]]
main()
"""


def test_ctrl_c_that_python_swallows_still_ends_ws(tmp_path):
    """A Ctrl-C whose KeyboardInterrupt Python raised inside a weak reference's callback (the
    import machinery's, as a command imports what it needs) or a collection's is "ignored": it
    printed "Exception ignored in …" and ``ws follow`` went on waiting for ever."""
    ws.publish(tmp_path / "run", {"w": np.zeros(2, np.float32)}, step=1)
    started = subprocess.Popen([sys.executable, "-c", SWALLOWED_WHILE_FOLLOWING, "follow", str(tmp_path / "run"),
                                "--after", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    try:
        out, err = started.communicate(timeout=60)
    finally:
        if started.poll() is None:
            started.kill()
            started.communicate()
    assert (started.returncode, out) == (130, ""), err
    assert err.endswith("interrupted\n") and "Traceback" not in err and "ignored" not in err, err


#: what ``ws follow run --after 1`` says on stderr once it has looked, before the Ctrl-C
WAITS_ABOVE_1 = "its latest version is step 1; waiting for a version above step 1"


def test_ctrl_c_while_ws_starts_exits_130_quietly(tmp_path):
    """Ctrl-C in the half second ``ws`` spends importing, before any command runs, printed a
    traceback of whichever module Python was in. The console script's entry, as pyproject.toml
    names it and pip calls it, handles it from its first line: an interrupt anywhere in the
    start, or in the command after it, says "interrupted" and exits 130."""
    entry = re.search(r'^ws = "([\w.]+):(\w+)"', (Path(__file__).parents[1] / "pyproject.toml").read_text(), re.M)
    assert entry is not None
    module, function = entry.groups()
    script = (f"import sys\nfrom {module} import {function}\n"
              "print('started', 'weightstore' in sys.modules, flush=True)\n"  # Python's own start is behind
              f"sys.exit({function}())\n")
    ws.publish(tmp_path / "run", {"w": np.zeros(2, np.float32)}, step=1)
    for delay in (0.01, 0.05, 0.1, 0.2, 0.35, 0.5, 0.6, 0.7, 0.8, 1.5):  # imports, typer's parsing, the follow
        started = subprocess.Popen([sys.executable, "-c", script, "follow", str(tmp_path / "run"), "--after", "1"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert started.stdout.readline() == "started False\n"  # the entry is in place before weightstore's imports
            time.sleep(delay)
            started.send_signal(signal.SIGINT)
            out, err = started.communicate(timeout=60)
        finally:
            started.kill()
        said = [line for line in err.splitlines() if not line.endswith(WAITS_ABOVE_1)]  # said once the follow looked
        assert (started.returncode, out, said) == (130, "", ["interrupted"]), (delay, err)


def test_ctrl_c_while_python_m_weightstore_starts_exits_130_quietly(tmp_path):
    """``python -m weightstore`` imports the whole package before its ``__main__`` runs, and a
    Ctrl-C there printed a traceback of whichever module Python was in (the console script's
    entry was quiet). The package's first lines make it as quiet: "interrupted", exit 130."""
    ws.publish(tmp_path / "run", {"w": np.zeros(2, np.float32)}, step=1)
    for delay in (0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.5):  # the package, the command's imports, the follow
        started = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "weightstore", "follow",
                                    str(tmp_path / "run"), "--after", "1"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for line in started.stderr:  # each module as its import ends: one of the package's is past its first lines
                if line.split("|")[-1].strip().startswith("weightstore."):
                    break
            time.sleep(delay)
            started.send_signal(signal.SIGINT)
            out, err = started.communicate(timeout=60)
        finally:
            started.kill()
        said = [line for line in err.splitlines() if not line.startswith("import time:") and not line.endswith(WAITS_ABOVE_1)]
        # -2: CPython under -m ends by SIGINT (a shell shows 130 as well) once a KeyboardInterrupt
        # ended code run from a string (a dataclass's generated methods, while typer imports
        # pydantic), even one caught and answered since, as here: "interrupted", exit 130
        assert (started.returncode in (130, -signal.SIGINT), out, said) == (True, "", ["interrupted"]), (
            delay, started.returncode, err[-2000:])


@pytest.mark.parametrize("args", [["ls", "{big}"], ["ls", "--json", "{big}"], ["diff", "{big}", "{small}"],
                                  ["--help"], ["ls", "--help"], ["--version"]])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, store, args):
    """``ws ls big.npz | head -1`` exited 1 (typer's and rich's answer to a closed pipe), which a
    script reads as a failure, and from ``ws diff`` as "different". Now it ends as ``ls | head``
    does: no line on stderr, and the status a shell shows for a command SIGPIPE stopped."""
    big = tmp_path / "big.npz"
    ws.save(big, {f"layer_{i}/kernel": np.zeros(4, np.float32) for i in range(3000)})
    command = [WS, *(arg.format(big=big, small=store) for arg in args)]
    gone = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gone.stdout.close()  # a reader that went before the first line (``| true``)
    assert (gone.wait(timeout=60), gone.stderr.read()) == (141, "")
    gone.stderr.close()
    head = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    head.stdout.readline()
    head.stdout.close()  # ``| head -1``: the output that fitted the pipe was written whole (its status), or cut (141)
    whole = 1 if args[0] == "diff" else 0  # "different": diff's 59 KB fit the pipe once the first line was read
    assert (head.wait(timeout=60) in (whole, 141), head.stderr.read()) == (True, "")
    head.stderr.close()


SELECTION_WORDS = {"--scope", "--include", "--exclude", "--map", "--trainable-only", "--also"}


@pytest.mark.parametrize("doc", ["README.md", "docs/cli.md"])
def test_the_selection_words_the_docs_give_each_command_are_the_ones_it_takes(doc):
    """Found as a user: the docs listed every selection word beside the commands, and ``ws ls
    --trainable-only`` was no option. Each clause of the sentence that lists them (``--scope``,
    ``--include``, ``--exclude`` in ``ls``, ...) names words and commands: together, exactly the
    selection words each command takes."""
    import typer.main

    text = " ".join((Path(__file__).parents[1] / doc).read_text().split())
    sentence = re.search(r"The words mean what they mean in [^:]*: (.*?)\.", text)
    assert sentence, doc
    documented: dict[str, set[str]] = {}
    for clause in sentence.group(1).split(";"):
        for command in re.findall(r"`(?:ws )?([a-z]+)`", clause):
            documented.setdefault(command, set()).update(re.findall(r"`(--[a-z-]+)`", clause))
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    taken = {name: words for name, command in commands.items()
             if (words := {opt for param in command.params for opt in param.opts} & SELECTION_WORDS)}
    assert documented == taken


def _documented_json_fields() -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """docs/cli.md's table of ``--json`` fields: command -> (top-level fields, nested "each:" fields)."""
    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    table = {}
    for commands, fields in re.findall(r"^\| (`[a-z].*?`) \| (.+) \|$", text, re.MULTILINE):
        nested = {name: re.findall(r"`(\w+)`", inner) for name, inner in
                  re.findall(r"`(\w+)` \(each[^:]*: ([^)]*)\)", fields)}
        top = re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", fields))
        for command in re.findall(r"`(\w+(?: [A-Z]+)?)`", commands):  # `verify FOLDER`: another shape
            table[command] = (top, nested)
    return table


def test_every_command_prints_the_json_fields_docs_cli_md_lists(tmp_path):
    """The contract: every command has --json with one documented shape. Each command runs as
    the ``ws`` script runs it (its entry, its stdout alone), and its object has exactly the
    fields the table names."""
    documented = _documented_json_fields()
    a, b, run_folder = tmp_path / "a.npz", tmp_path / "b.npz", tmp_path / "run"
    ws.save(a, {"w": np.zeros(3, np.float32), "v": np.ones(2, np.float32)})
    ws.save(b, {"w": np.ones(3, np.float32), "v": np.ones(2, np.float32)})
    ws.publish(run_folder, {"w": np.zeros(3, np.float32)}, step=1)
    commands = {
        "ls": ["ls", a], "export": ["export", a, "-o", tmp_path / "e.npz"],
        "import": ["import", a, "--into", tmp_path / "i.npz", "--scope", "m"],
        "convert": ["convert", a, tmp_path / "c.h5"], "diff": ["diff", a, b], "verify": ["verify", a],
        "verify FOLDER": ["verify", run_folder], "versions": ["versions", run_folder], "follow": ["follow", run_folder, "--timeout", "0"],
        "clean": ["clean", run_folder],
    }
    assert set(commands) == set(documented)
    runs = ws_in_turn([[*args, "--json"] for args in commands.values()])
    for command, (status, stdout, stderr) in zip(commands, runs, strict=True):
        assert status == (1 if command == "diff" else 0), (command, stderr)
        document = json.loads(stdout.splitlines()[0] if command == "follow" else stdout)
        top, nested = documented[command]
        assert list(document) == ["command", "ok", *top], command
        assert (document["command"], document["ok"]) == (command.split()[0], True)
        for name, fields in nested.items():
            assert document[name] and list(document[name][0]) == fields, (command, name)


# -- the CLI as people type it ----------------------------------------------------------------

def test_export_trainable_only_also_keeps_chosen_statistics(made, tmp_path):
    out = tmp_path / "seed.npz"
    result = run("export", made["tf1"], "-o", out, "--trainable-only", "--also", "model/stats", "--exclude", "*/Adam*")
    assert result.exit_code == 0, result.output
    assert sorted(ws.load(out)) == ["model/dense/b", "model/dense/w", "model/emb", "model/stats"]
    result = run("export", made["tf1"], "-o", tmp_path / "x.npz", "--also", "model/stats")
    assert result.exit_code == 2 and "--also adds to what --trainable-only keeps" in result.output
    result = run("export", made["tf1"], "-o", tmp_path / "y.npz", "--trainable-only", "--also", "*/bn/moving_*")
    assert result.exit_code != 0 and not os.path.exists(tmp_path / "y.npz")
    assert "--also '*/bn/moving_*' matches no key; did you mean" in result.output
    # a source that does not record trainability says so first, whatever --also names
    one_error_line(run("export", made["tf1_nometa"], "-o", tmp_path / "z.npz", "--trainable-only", "--also",
                       "*/bn/moving_*"), "--trainable-only needs the graph file")


@pytest.mark.parametrize("flag", ["-q", "--quiet", "--debug"])
def test_global_flags_also_after_the_command(store, tmp_path, flag):
    out = tmp_path / "copy.npz"
    result = run("convert", store, out, flag)
    assert result.exit_code == 0, result.output
    if flag != "--debug":
        assert result.stderr == ""  # quiet: no "wrote …" note
    assert sorted(ws.load(out)) == sorted(ws.load(store))


def test_json_on_every_command_has_one_shape(store, tmp_path):
    results = {
        "ls": run("ls", store, "--json"),
        "diff": run("diff", store, store, "--json"),
        "convert": run("convert", store, tmp_path / "c.h5", "--json"),
        "export": run("export", store, "-o", tmp_path / "e.npz", "--scope", "dense", "--json"),
        "import": run("import", store, "--into", tmp_path / "i.npz", "--scope", "m", "--json"),
        "verify": run("--json", "verify", store),
    }
    for command, result in results.items():
        assert result.exit_code == 0, (command, result.output)
        document = json.loads(result.stdout)
        assert document["command"] == command and document["ok"] is True, document
    assert results["export"].stderr == ""  # the result is on stdout, not a note on stderr
    export = json.loads(results["export"].stdout)
    assert (export["count"], export["path"], export["kind"]) == (2, str(tmp_path / "e.npz"), "store")
    assert json.loads(results["verify"].stdout)["problems"] == []


def test_json_error_names_the_type_the_file_and_exits_1(tmp_path):
    missing = tmp_path / "missing.npz"
    result = run("ls", missing, "--json")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["ok"] is False and document["command"] == "ls"
    assert document["error"]["type"] == "StoreNotFoundError" and str(missing) in document["error"]["message"]
    one_error_line(result, str(missing))


def _truncated_safetensors(tmp_path) -> tuple[list[str], str, str | None]:
    path = tmp_path / "m.safetensors"
    ws.save(path, {"w": np.ones(8, np.float32)})
    path.write_bytes(path.read_bytes()[:-4])
    return ["ls", str(path)], str(path), "w"


def _corrupt_npz(tmp_path) -> tuple[list[str], str, str | None]:
    path = tmp_path / "m.npz"
    ws.save(path, {"w": np.ones(8, np.float32)})
    raw = bytearray(path.read_bytes())
    raw[raw.index(np.ones(8, np.float32).tobytes())] ^= 0x01
    path.write_bytes(bytes(raw))
    return ["verify", str(path)], str(path), "w"  # the one corrupt tensor


def _checkpoint_without_its_data(tmp_path) -> tuple[list[str], str, str | None]:
    prefix = tf_forge.write(tmp_path / "model.ckpt", {"w": np.ones((2, 3), np.float32)})
    os.remove(prefix + ".data-00000-of-00001")
    return ["convert", prefix, str(tmp_path / "out.npz")], prefix + ".data-00000-of-00001", "w"


def _folder_of_versions_not_there(tmp_path) -> tuple[list[str], str, str | None]:
    return ["versions", str(tmp_path / "typo")], str(tmp_path / "typo"), None  # (a damaged LATEST is listed past)


def _key_too_long_for_the_target(tmp_path) -> tuple[list[str], str, str | None]:
    source, target = tmp_path / "m.npz", str(tmp_path / "out.npz")
    ws.save(source, {"w": np.ones(2, np.float32)})
    scope = "s" * 65530  # with "/w", past the longest member name npz holds
    return ["import", str(source), "--into", target, "--scope", scope], target, f"{scope}/w"


def _dtype_the_target_cannot_hold(tmp_path) -> tuple[list[str], str, str | None]:
    source, target = tmp_path / "m.npz", str(tmp_path / "out.safetensors")
    ws.save(source, {"ok": np.ones(2, np.float32), "c": np.ones(2, np.complex128)})
    return ["convert", str(source), target], target, "c"


def _suffix_that_names_no_format(tmp_path) -> tuple[list[str], str, str | None]:
    source, target = tmp_path / "m.npz", str(tmp_path / "out.xyz")
    ws.save(source, {"w": np.ones(2, np.float32)})
    return ["export", str(source), "-o", target], target, None


def _two_keys(tmp_path) -> str:
    source = str(tmp_path / "m.npz")
    ws.save(source, {"dense/w": np.ones((2, 3), np.float32), "dense/b": np.ones(3, np.float32)})
    return source


def _include_that_matches_nothing(tmp_path) -> tuple[list[str], str, str | None]:
    source = _two_keys(tmp_path)
    return ["export", source, "-o", str(tmp_path / "out.npz"), "--include", "dense/kernel"], source, None


def _also_that_matches_nothing(tmp_path) -> tuple[list[str], str, str | None]:
    source = _two_keys(tmp_path)
    return ["export", source, "-o", str(tmp_path / "out.npz"), "--trainable-only", "--also", "*/moving_*"], source, None


def _import_selection_that_keeps_nothing(tmp_path) -> tuple[list[str], str, str | None]:
    source = _two_keys(tmp_path)
    return ["import", source, "--into", str(tmp_path / "out.npz"), "--exclude", "dense/*"], source, None


def _mapping_that_merges_two_keys(tmp_path) -> tuple[list[str], str, str | None]:
    source = _two_keys(tmp_path)
    return ["import", source, "--into", str(tmp_path / "out.npz"), "--map", "dense/w=x", "--map", "dense/b=x"], source, "x"


def _corrupt_tensor_converted(tmp_path) -> tuple[list[str], str, str | None]:
    args, path, _ = _corrupt_npz(tmp_path)
    return ["convert", path, str(tmp_path / "out.h5")], path, "w"  # one tensor read, and it is corrupt


def _pickle_given_as_weights(tmp_path) -> tuple[list[str], str, str | None]:
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x80\x04\x95" + bytes(64))  # a pickle's first bytes: refused, never unpickled
    return ["ls", str(path)], str(path), None


def _shard_size_of_nothing(tmp_path) -> tuple[list[str], str, str | None]:
    target = str(tmp_path / "hf")
    return ["convert", _two_keys(tmp_path), target, "--max-shard-size", "0"], target, None


def _key_no_torch_name_reads_back(tmp_path) -> tuple[list[str], str, str | None]:
    target = str(tmp_path / "out.safetensors")
    return ["export", _two_keys(tmp_path), "-o", target, "--names", "torch", "--map", "dense=a.b"], target, "a.b/w"


def _tensor_no_layout_rule_converts(tmp_path) -> tuple[list[str], str, str | None]:
    source = str(tmp_path / "odd.npz")
    ws.save(source, {"fc/kernel": np.ones((2, 3)), "fc/alpha": np.ones(3)})
    return ["convert", source, str(tmp_path / "out.npz"), "--layout", "keras-to-torch"], source, None


@pytest.mark.parametrize("damaged", [_truncated_safetensors, _corrupt_npz, _checkpoint_without_its_data,
                                     _folder_of_versions_not_there, _key_too_long_for_the_target,
                                     _dtype_the_target_cannot_hold, _suffix_that_names_no_format,
                                     _include_that_matches_nothing, _also_that_matches_nothing,
                                     _import_selection_that_keeps_nothing, _mapping_that_merges_two_keys,
                                     _corrupt_tensor_converted, _pickle_given_as_weights, _shard_size_of_nothing,
                                     _key_no_torch_name_reads_back, _tensor_no_layout_rule_converts],
                         ids=["ls", "verify", "convert", "versions", "save-key", "save-dtype", "save-suffix",
                              "include", "also", "import-selection", "mapping", "corrupt-tensor", "pickle",
                              "shard-size", "torch-name", "layout"])
def test_json_errors_carry_the_file_and_the_key(tmp_path, damaged):
    """Scripts filter failures by ``error.path``/``error.key``; the message still names both,
    the file once, at its head."""
    args, path, key = damaged(tmp_path)
    result = run(*args, "--json")
    error = json.loads(result.stdout)["error"]
    assert (error["path"], error["key"], error["keys"]) == (path, key, [key] if key else [])
    shown = repr(key) if key and len(key) <= 200 else f"{key[:160]!r}…" if key else ""  # a long key: by its ends
    line = one_error_line(result, path, *([f"tensor {shown}"] if key else []))
    assert line.startswith(f"error: {path}: ") and line.count(path) == 1, line


def _keras_file_given_a_key_it_lacks(made, tmp_path) -> tuple[list[str], str, str | None]:
    target = str(tmp_path / "model.keras")
    shutil.copy(made["root"] / "model.keras", target)
    ws.save(tmp_path / "w.npz", {"d9/kernel": np.ones((3, 4), np.float32)})
    return ["import", str(tmp_path / "w.npz"), "--into", target, "--overwrite"], target, "d9/kernel"


def _keras_file_given_a_wrong_shape(made, tmp_path) -> tuple[list[str], str, str | None]:
    target = str(tmp_path / "model.weights.h5")
    shutil.copy(made["root"] / "model.weights.h5", target)
    with ws.open(target) as opened:
        key = opened.keys()[0]
        shape = opened.info(key).shape
    ws.save(tmp_path / "w.npz", {key: np.ones((*shape, 2), np.float32)})
    return ["import", str(tmp_path / "w.npz"), "--into", target, "--overwrite"], target, key


def _object_checkpoint_given_a_wrong_shape(made, tmp_path) -> tuple[list[str], str, str | None]:
    target = copy_checkpoint(made["module"], tmp_path)
    ws.save(tmp_path / "w.npz", {"net/w": np.ones((3, 3), np.float32)})
    return ["import", str(tmp_path / "w.npz"), "--into", target], target, "net/w"


@pytest.mark.parametrize("refused", [_keras_file_given_a_key_it_lacks, _keras_file_given_a_wrong_shape,
                                     _object_checkpoint_given_a_wrong_shape],
                         ids=["keras-key", "keras-shape", "checkpoint-shape"])
def test_json_errors_of_an_import_carry_the_target_and_the_key(made, tmp_path, refused):
    args, path, key = refused(made, tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    result = run(*args, "--json")
    error = json.loads(result.stdout)["error"]
    assert (error["path"], error["key"]) == (path, key)
    one_error_line(result, f"{path}: tensor {key!r}: ")
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before  # nothing written


def test_a_folder_given_as_the_output_is_told_how_a_folder_is_written(store, tmp_path):
    there = tmp_path / "there"
    there.mkdir()
    for target in (f"{tmp_path / 'new'}/", there):  # a folder's name, and a folder that is there
        one_error_line(run("convert", store, target), "cannot tell which format",
                       "a folder of safetensors shards is written with max_shard_size= (ws convert --max-shard-size)")
    assert not (tmp_path / "new").exists() and os.listdir(there) == []
    assert "max_shard_size" not in run("convert", store, tmp_path / "out.xyz").output  # a file's name: not said


@pytest.mark.parametrize("name", ["out.safetensors.bak", "out.xyz"])
def test_unknown_output_suffix_is_refused_before_anything_is_read(store, tmp_path, name):
    result = run("export", store, "-o", tmp_path / name)
    # ws has no --format: the Python-only way out is said to be that
    one_error_line(result, "cannot tell which format to write from the file name", "name it with one of .npz")
    assert not (tmp_path / name).exists()
    one_error_line(run("convert", store, tmp_path / name), "cannot tell which format")


@pytest.mark.slow  # a ws process importing TensorFlow
def test_tensorflow_logs_stay_out_whatever_the_environment_says(store, tmp_path):
    """Writing a TF checkpoint imports TensorFlow; its C++ lines must not reach stderr even when
    the shell asks TensorFlow for every log line."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
    done = subprocess.run([WS, "import", str(store), "--into", str(tmp_path / "m.ckpt")], capture_output=True,
                          text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines() == [f"wrote 3 tensors (48 B) into TF checkpoint {tmp_path / 'm.ckpt'}",
                                                transfer.NAME_BASED_CAUTION.format(target=tmp_path / "m.ckpt")]


# -- import into TF2 object checkpoints and new prefixes; export keyed like a Keras model ---------

def test_import_replaces_object_checkpoint_values_that_checkpoint_restore_reads(made, tmp_path):
    target = copy_checkpoint(made["keras_ckpt"], tmp_path)
    exported = run("export", target, "-o", tmp_path / "model.npz", "--scope", "model", "--exclude", "optimizer")
    assert exported.exit_code == 0, exported.output
    changed = {key: value + 1 for key, value in ws.load(tmp_path / "model.npz").items()}
    ws.save(tmp_path / "changed.npz", changed)
    dense = next(key.rsplit("/", 1)[0] for key in changed if key.endswith("/_kernel"))  # the first Dense layer
    result = run("import", tmp_path / "changed.npz", "--into", target, "--scope", "model", "--include", f"{dense}/*")
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == f"wrote 2 tensors (64 B) into TF2 object-based checkpoint {target}"
    model = same_architecture()
    tf.train.Checkpoint(model=model).restore(target).expect_partial()
    d1, bn = model.get_layer("d1"), model.get_layer("bn")
    np.testing.assert_array_equal(d1.kernel.numpy(), changed[f"{dense}/_kernel"])
    np.testing.assert_array_equal(d1.bias.numpy(), changed[f"{dense}/bias"])
    np.testing.assert_array_equal(bn.gamma.numpy(), made["model"].get_layer("bn").gamma.numpy())  # not included


def test_import_into_an_object_checkpoint_refuses_keys_it_lacks(made, store, tmp_path):
    target = copy_checkpoint(made["module"], tmp_path)
    index = tmp_path / (os.path.basename(target) + ".index")
    before = index.read_bytes()
    one_error_line(run("import", store, "--into", target),
                   f"{target}: the TF2 object-based checkpoint has no variable 'dense/w', 'dense/b', 'head/w'; "
                   "tf.train.Checkpoint.restore ignores entries its object graph does not name",
                   "model keys (dense/kernel) go into a live model instead: tf2.assign")
    ws.save(tmp_path / "extra.npz", {"net/w": np.ones((2, 2), np.float32), "net/extra": np.ones(2, np.float32)})
    done = run("import", tmp_path / "extra.npz", "--into", target, "--json")
    assert done.exit_code == 1 and "Traceback" not in done.output, done.output
    error = json.loads(done.stdout)["error"]  # one key at fault: --json names it, as docs/cli.md says
    assert (error["type"], error["path"], error["key"], error["keys"]) == ("SelectionError", target, "net/extra",
                                                                         ["net/extra"])
    ws.save(tmp_path / "w.npz", {"net/w": np.ones((3, 3), np.float32)})
    one_error_line(run("import", tmp_path / "w.npz", "--into", target),
                   "tensor 'net/w': is float32 [2, 2] in the checkpoint, the imported tensor is float32 [3, 3]")
    assert index.read_bytes() == before


def test_import_into_a_folder_names_the_checkpoint_it_holds(made, tmp_path):
    """A folder holding one checkpoint (``Checkpoint.write``: no state file) is refused naming
    that prefix, not a new ``model.ckpt`` beside it, which would be a TF1 checkpoint."""
    (tmp_path / "ck2").mkdir()
    target = copy_checkpoint(made["keras_ckpt"], tmp_path / "ck2")
    ws.save(tmp_path / "fixed.npz", ws.load(target, scope="model", exclude="optimizer"))
    before = sorted(os.listdir(tmp_path / "ck2"))
    one_error_line(run("import", tmp_path / "fixed.npz", "--into", tmp_path / "ck2", "--scope", "model", "--overwrite"),
                   f"ck2: is a folder; give the prefix of the checkpoint it holds: --into {target}")
    assert sorted(os.listdir(tmp_path / "ck2")) == before
    done = run("import", tmp_path / "fixed.npz", "--into", target, "--scope", "model", "--overwrite")
    assert done.exit_code == 0, done.output
    (tmp_path / "empty").mkdir()
    one_error_line(run("import", tmp_path / "fixed.npz", "--into", tmp_path / "empty"),
                   f"empty: is a folder; give a checkpoint prefix such as {tmp_path / 'empty' / 'model.ckpt'}")


def test_import_of_a_new_prefix_makes_its_folder_state_file_and_says_restore_ignores_it(store, tmp_path):
    folder = tmp_path / "new" / "run"
    prefix = str(folder / "model.ckpt-1")
    result = run("import", store, "--into", prefix, "--scope", "m")
    assert result.exit_code == 0, result.output
    assert result.stderr.strip().splitlines()[1] == (
        f"note: {prefix} is a name-based checkpoint: tf.compat.v1.train.Saver, tf.train.load_checkpoint and ws "
        "read it, tf.train.Checkpoint.restore does not (it would silently restore nothing); to load it into a "
        "Keras model use weightstore.adapters.tf2.assign(model, store)")
    assert tf.train.latest_checkpoint(str(folder)) == prefix
    weights = {f"m/{k}": v for k, v in ws.load(store).items()}
    for key, value in restore_with_saver(prefix, {k: v.shape for k, v in weights.items()}).items():
        np.testing.assert_array_equal(value, weights[key])
    assert run("export", folder, "-o", tmp_path / "back.npz", "--scope", "m").exit_code == 0
    assert sorted(ws.load(tmp_path / "back.npz")) == sorted(ws.load(store))
    second = run("import", store, "--into", folder / "model.ckpt-2", "--json")
    assert json.loads(second.stdout)["caution"] == transfer.NAME_BASED_CAUTION.format(target=folder / "model.ckpt-2")
    assert tf.train.latest_checkpoint(str(folder)) == str(folder / "model.ckpt-2")
    merged = run("import", store, "--into", prefix, "--scope", "n")  # an existing TF1 checkpoint: merged, no note
    assert merged.exit_code == 0 and "note:" not in merged.stderr
    assert tf.train.latest_checkpoint(str(folder)) == str(folder / "model.ckpt-2")


@pytest.mark.parametrize("state, message", [
    ("garbage\n", "checkpoint state file names no model_checkpoint_path"),
    ('model_checkpoint_path: "old"\nall_model_checkpoint_paths: "a\\x"\n',
     "checkpoint state file has an empty or malformed all_model_checkpoint_paths"),
    (None, "is not a regular file (a FIFO)"),  # opened blocking, it would wait for a writer forever
])
def test_import_refuses_a_bad_state_file_before_writing(store, tmp_path, state, message):
    if state is None:
        os.mkfifo(tmp_path / "checkpoint")
    else:
        (tmp_path / "checkpoint").write_text(state)
    one_error_line(run("import", store, "--into", tmp_path / "m.ckpt"), "checkpoint", message)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "m.npz"]


KEYED_LIKE_THE_MODEL = [
    ("model.keras", ["--model-keys"]),
    ("model.weights.h5", ["--model", "model.keras"]),
    ("tf2", ["--model", "model.keras"]),  # a TF2 checkpoint folder, saved with the optimizer
]


@pytest.mark.parametrize("source, options", KEYED_LIKE_THE_MODEL)
def test_export_keyed_like_the_model(made, tmp_path, source, options):
    from weightstore.adapters import tf2

    root = made["root"]
    options = [root / o if o.endswith(".keras") else o for o in options]
    result = run("export", root / source, "-o", tmp_path / "out.npz", *options, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["keyed_like"] == str(root / "model.keras")
    exported, expected = ws.load(tmp_path / "out.npz"), tf2.export(made["model"])
    assert sorted(exported) == sorted(expected) and "d1/kernel" in exported  # no optimizer state
    for key, value in expected.items():
        np.testing.assert_array_equal(exported[key], value)


@pytest.mark.parametrize("source, options", KEYED_LIKE_THE_MODEL)
def test_export_trainable_only_asks_the_model_it_is_keyed_like(made, tmp_path, source, options):
    from weightstore.adapters import tf2

    root = made["root"]
    options = [root / o if o.endswith(".keras") else o for o in options]
    for also in (None, "bn/moving_*"):
        out = tmp_path / f"{also is None}.npz"
        result = run("export", root / source, "-o", out, *options, "--trainable-only", *(["--also", also] if also else []))
        assert result.exit_code == 0, result.output
        exported, expected = ws.load(out), tf2.export(made["model"], trainable_only=True, also=also)
        assert sorted(exported) == sorted(expected) and ("bn/moving_mean" in exported) == bool(also)
        for key, value in expected.items():
            np.testing.assert_array_equal(exported[key], value)


def test_export_trainable_only_of_a_keras_archive_asks_its_own_model_without_model_keys(made, tmp_path):
    """A .keras carries its model: ``--trainable-only`` builds it as ``--model-keys`` would, where it
    once refused, saying to add ``--model-keys``; the selective export matches ``tf2.export``'s."""
    from weightstore.adapters import tf2

    for also in (None, "bn/moving_*"):
        out = tmp_path / f"{also is None}.npz"
        result = run("export", made["root"] / "model.keras", "-o", out, "--trainable-only",
                     *(["--also", also] if also else []), "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["keyed_like"] == str(made["root"] / "model.keras")
        exported, expected = ws.load(out), tf2.export(made["model"], trainable_only=True, also=also)
        assert sorted(exported) == sorted(expected) and ("bn/moving_mean" in exported) == bool(also)
        for key, value in expected.items():
            np.testing.assert_array_equal(exported[key], value)


def test_export_trainable_only_without_a_model_says_how_to_give_one(made, store, tmp_path):
    out = tmp_path / "out.npz"
    for source in (made["root"] / "model.weights.h5", made["root"] / "tf2"):
        line = one_error_line(run("export", source, "-o", out, "--trainable-only"),
                              "does not record which variables are trainable: pass --model model.keras, whose model "
                              "knows", "tf2.export(model, trainable_only=True)")
        assert "--model-keys" not in line  # what only a .keras SOURCE needs, and --trainable-only implies there
    line = one_error_line(run("export", store, "-o", out, "--trainable-only"),
                          "tf2.export(model, trainable_only=True) (torch.export, flax.export alike)")
    assert "--model" not in line  # a store cannot be keyed like a model
    assert not out.exists()


def test_export_keyed_like_the_model_says_so_and_selects_by_model_keys(made, tmp_path):
    result = run("export", made["root"] / "model.keras", "-o", tmp_path / "d1.npz", "--model-keys", "--scope", "d1")
    assert result.exit_code == 0, result.output
    archive = made["root"] / "model.keras"
    assert result.stderr.strip() == (f"wrote 2 tensors (64 B) from Keras weights file {archive} "
                                     f"to {tmp_path / 'd1.npz'}, keyed like the model of {archive}")
    assert sorted(ws.load(tmp_path / "d1.npz")) == ["bias", "kernel"]


def test_export_keyed_like_a_model_refuses_what_it_cannot_pair(made, store, tmp_path):
    out = tmp_path / "out.npz"
    one_error_line(run("export", store, "-o", out, "--model-keys"),
                   f"{store}: has no model config to key it by (--model-keys); name a .keras file with --model")
    one_error_line(run("export", store, "-o", out, "--model", made["root"] / "model.keras"),
                   f"{store}: is a weightstore file; only Keras files and TF2 object-based checkpoints")
    one_error_line(run("export", made["tf1"], "-o", out, "--model", made["root"] / "model.keras"),
                   "is a TF1 checkpoint; only Keras files and TF2 object-based checkpoints")
    one_error_line(run("export", made["root"] / "model.weights.h5", "-o", out, "--model", store),
                   f"{store}: is not a .keras file; the model's architecture comes from the config.json of one")
    other = keras.Sequential([keras.Input((5, 5, 1)), keras.layers.Conv2D(2, 3), keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    other.save_weights(tmp_path / "other.weights.h5")
    for command in (["export", tmp_path / "other.weights.h5", "-o", out],
                    ["convert", tmp_path / "other.weights.h5", out]):
        one_error_line(run(*command, "--model", made["root"] / "model.keras"),
                       f"other.weights.h5: does not fit the model of {made['root'] / 'model.keras'}: 2 tensors the "
                       "model has no variable for ('layers/conv2d/vars/0', 'layers/conv2d/vars/1')")
    assert not out.exists()


class Doubler(keras.layers.Layer):
    """A custom layer: its class lives in this test module, which ws must never import or run."""

    def call(self, inputs):
        return inputs * 2


@pytest.mark.parametrize("layer, message", [
    (lambda: keras.layers.Lambda(lambda x: x + 1),
     "its model has a Lambda layer or other Python code, which ws never runs"),
    (Doubler, "cannot rebuild its model from config.json (Could not locate class 'Doubler'); ws builds only "
              "Keras's own layers, never custom ones"),
])
def test_export_model_keys_refuses_code_in_the_config(tmp_path, layer, message):
    path = tmp_path / "custom.keras"
    keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), layer()]).save(path)
    result = run("export", path, "-o", tmp_path / "out.npz", "--model-keys", "--json")
    one_error_line(result, f"{path}: {message}")
    assert json.loads(result.stdout)["error"]["path"] == str(path)
    assert not (tmp_path / "out.npz").exists()


def test_shuffle_compression_from_the_command_line(tmp_path):
    weights = {"dense/kernel": np.random.default_rng(0).normal(0, 0.05, (256, 64)).astype(np.float32)}
    source = tmp_path / "m.npz"
    ws.save(source, weights)
    out = tmp_path / "small.npz"
    result = run("convert", source, out, "--shuffle")
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(ws.load(out)["dense/kernel"], weights["dense/kernel"])
    assert out.stat().st_size < source.stat().st_size
    with np.load(out) as plain:  # shuffled members are never offered to numpy as arrays
        assert "dense/kernel" not in plain.files


@pytest.mark.parametrize("command", ["convert", "export"])
def test_compress_and_shuffle_together_are_a_usage_error(tmp_path, command):
    """Two ways of compressing: ``--shuffle`` silently won over ``--compress``, so a user who
    gave both for a file plain numpy reads got one it cannot. Refused before anything is read."""
    source = tmp_path / "m.npz"
    ws.save(source, {"w": np.ones(4, np.float32)})
    out = tmp_path / "out.npz"
    args = [source, out] if command == "convert" else [source, "-o", out]
    result = run(command, *args, "--compress", "--shuffle", "--json")
    assert result.exit_code == 2, result.output
    assert "--compress deflates, --shuffle compresses with zstd" in json.loads(result.stdout)["error"]["message"]
    assert not out.exists()


def test_a_many_line_refusal_prints_as_one_line_its_parts_kept_apart(tmp_path):
    """A layout's refusals (or an assign's sections) are lines in Python; on the command line
    they are one line, each part set off by "; ", never run together. Names of a Keras file
    say what to read instead."""
    ws.save(tmp_path / "names.npz", {"layers/dense/vars/0": np.ones((3, 4), np.float32),
                                     "layers/dense/vars/1": np.ones(4, np.float32)})
    line = one_error_line(run("convert", tmp_path / "names.npz", tmp_path / "x.safetensors", "--layout",
                              "keras-to-torch"))
    assert "2 tensors the layout cannot convert exactly: layers/dense/vars/0: no torch layout rule" in line
    assert "(add a Rule with Layout.extended); layers/dense/vars/1: no torch layout rule" in line
    assert line.endswith("; (names like layers/dense/vars/0 are a Keras file's own: read the file keyed like its "
                         "model first, with ws export FILE --model-keys, or --model MODEL.keras for a .weights.h5)")
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("args, command, kind, says", [
    (["--json", "ls", "--scop", "dense", "{store}"], "ls", "NoSuchOption", "No such option: --scop"),
    (["ls", "{store}", "--json", "--bogus"], "ls", "NoSuchOption", "No such option: --bogus"),
    (["export", "{store}", "-o", "{out}", "--also", "dense", "--json"], "export", "BadParameter",
     "--also adds to what --trainable-only keeps"),
    (["--json", "lss", "{store}"], None, "UsageError", "No such command 'lss'"),
    (["--json", "--bogus", "ls", "{store}"], None, "NoSuchOption", "No such option: --bogus"),
])
def test_json_asked_for_gets_its_object_on_a_usage_error_too(store, tmp_path, args, command, kind, says):
    """Scripts parse stdout: a mistyped option (exit 2) must not leave it empty."""
    result = run(*(a.format(store=store, out=tmp_path / "o.npz") for a in args))
    assert result.exit_code == 2
    document = json.loads(result.stdout)
    assert document["command"] == command and document["ok"] is False
    assert document["error"]["type"] == kind and says in document["error"]["message"]
    assert "Usage:" in result.stderr and not (tmp_path / "o.npz").exists()
    plain = run(*(a.format(store=store, out=tmp_path / "o.npz") for a in args if a != "--json"))
    assert plain.exit_code == 2 and plain.stdout == ""  # without --json, nothing on stdout
