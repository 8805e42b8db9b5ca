"""A short seeded mutation fuzz of every format, of a versions folder's ``LATEST`` pointer, and of
the files a version is made of beside others (a delta and its base, a sharded version's
done-records, members and delta members, a Hugging Face index, a TF checkpoint's data), and of
mapping rules (``*/`` endings among them) over keys they rename.

Each target's mutants (bit flips, interesting bytes, truncations, insertions, deletions,
splices of a real file) must end in a WeightStoreError or read back exactly the original
(:mod:`fuzz.targets`). HDF5 runs in a subprocess: a crash in the C library is reported with
the mutant that caused it. The same targets run coverage-guided, for as long as anyone
wants, with ``./tasks fuzz``; what that finds goes to ``tests/data/regressions``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tf_forge
import weightstore as ws
from fuzz.targets import fuzz_batch, reseal_table, rich_checkpoint

#: mutants per target: a few seconds in all on a small machine
COUNT = {"npz": 300, "npz-many": 300, "npz-compressed": 300, "numpy-savez": 300, "latest": 300, "hdf5": 300,
         "safetensors": 200, "tf-index": 200, "tf-object-graph": 200, "keras-config": 200, "npz-numpy": 200,
         "keras": 100, "sharded-index": 300, "delta": 100, "delta-base": 50, "sharded-done": 30,
         "sharded-member": 30, "sharded-delta": 30, "hf-index": 60, "tf-data": 50, "mapping": 300}


@pytest.mark.parametrize("name", ["npz", "npz-many", "npz-compressed", "numpy-savez", "latest", "safetensors",
                                  "tf-index", "npz-numpy", "keras-config", "sharded-index", "delta", "delta-base",
                                  "sharded-done", "sharded-member", "sharded-delta", "hf-index", "mapping"])
def test_mutants_are_refused_or_read_exactly(tmp_path, name):
    outcomes = fuzz_batch(name, seed=20261201, count=COUNT[name], folder=tmp_path)
    assert outcomes.get("refused", 0) > COUNT[name] // 3, outcomes  # the mutations do reach the parsers


def test_object_graph_mutants_key_variables_or_fall_back(tmp_path):
    """A damaged graph keys what it still can, or nothing (the entry names then): never raises."""
    outcomes = fuzz_batch("tf-object-graph", seed=20261201, count=COUNT["tf-object-graph"], folder=tmp_path)
    assert outcomes == {"same": COUNT["tf-object-graph"]}


@pytest.mark.parametrize("name", ["hdf5", "keras"])
def test_hdf5_mutants_are_refused_or_read_exactly_in_a_subprocess(tmp_path, name):
    """HDF5 files, and ``.keras`` archives whose weights member is one."""
    tests = Path(__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "fuzz.run_batch", name, "20261201", str(COUNT[name]), str(tmp_path)],
        cwd=tests, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(tests)},
    )
    lines = result.stdout.splitlines()
    started = [line for line in lines if line.startswith("START")]
    assert result.returncode == 0, (
        f"exit {result.returncode}; last mutant: {started[-1] if started else None}\n"
        + "\n".join(line for line in lines if line.startswith("FINDING")) + result.stderr[-2000:]
    )
    assert any(line.startswith("OUTCOMES") for line in lines)


def test_tf_index_mutants_are_resealed_to_reach_the_entries(tmp_path):
    """A damaged entry in a TF checkpoint index fails its data block's CRC-32C check; resealed
    (as the tf-index target reseals each mutant) it reaches the entry's protobuf parse."""
    tf_forge.write(tmp_path / "ckpt", {"w": np.zeros(3, np.float32)})
    index = tmp_path / "ckpt.index"
    raw = bytearray(index.read_bytes())
    raw[raw.index(b"w") + 1] = 0xFF  # the entry's first tag: field 31, wire type 7, which no message has
    for data, refusal in ((bytes(raw), "fails its CRC-32C check"), (reseal_table(bytes(raw)), "protocol buffer")):
        index.write_bytes(data)
        with pytest.raises(ws.FormatError, match=refusal):
            ws.load(tmp_path / "ckpt")


def test_tf_data_mutants_are_resealed_to_reach_the_object_graph(tmp_path):
    """A damaged byte in a TF checkpoint's data file fails its entry's CRC-32C check; resealed
    (as the tf-data target reseals each mutant: its index written anew around it) it reaches
    what the bytes hold: here an edge's name in the object graph, which keys a variable."""
    index = rich_checkpoint(tmp_path)
    data_file = tmp_path / "ckpt.data-00000-of-00001"
    data = data_file.read_bytes()
    data_file.write_bytes(data.replace(b"\x06kernel", b"\x06kernal", 1))
    with pytest.raises(ws.ChecksumError, match="CRC-32C"):
        ws.load(index)
    rich_checkpoint(tmp_path, data_file.read_bytes())
    assert sorted(ws.load(index)) == ["model/bias", "model/codes", "model/empty", "model/kernal"]
    (tmp_path / "fuzz").mkdir()
    outcomes = fuzz_batch("tf-data", seed=20261201, count=COUNT["tf-data"], folder=tmp_path / "fuzz")
    assert outcomes.get("same", 0) > COUNT["tf-data"] // 2, outcomes  # most reach past the seals and read


def test_coverage_guided_fuzzing_sees_the_readers_imported_at_their_first_file(tmp_path):
    """``./tasks fuzz`` instruments every reader a target reaches, those weightstore imports at
    the first file of their format too: uninstrumented, a TF2 object graph's parse showed the
    fuzzer 9 edges, whatever a mutant did, and the fuzz ran blind."""
    pytest.importorskip("atheris")
    tests = Path(__file__).parent
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "fuzz.coverage", "--child", "--target", "tf-object-graph", str(corpus), "-runs=1"],
        cwd=tests, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    edges = int(re.search(r"INITED cov: (\d+)", result.stderr)[1])
    assert edges > 30, result.stderr[-2000:]  # the seed alone runs parse_object_graph, object_graph_keys, best_paths
