"""ml_dtypes costs about a CPU-second to import: ``import weightstore``, the ``ws`` CLI and files
of numpy's dtypes never import it; a file or array of one of its kinds (bfloat16) does."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from pathlib import Path
import numpy as np
import weightstore as ws

def imported():
    return "ml_dtypes" in sys.modules

folder = Path(sys.argv[1])
print("import", imported())
plain = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, -2], np.int8)}
plain |= {f"many/{i}": np.full(3, i, np.float16) for i in range(20)}  # enough to be read together
for name in ("plain.npz", "plain.safetensors", "plain.h5"):
    ws.save(folder / name, plain)
    back = ws.load(folder / name)
    assert all(np.array_equal(back[k], plain[k]) and back[k].dtype == plain[k].dtype for k in plain)
print("plain", imported())
"""

BFLOAT16 = """
import sys
from pathlib import Path
import numpy as np
import weightstore as ws

folder = Path(sys.argv[1])
for name in ("bf.npz", "bf.safetensors"):
    back = ws.load(folder / name)["w"]
    assert back.dtype.name == "bfloat16" and back.astype(np.float32).tolist() == [1.0, -2.5, 3.0], name
print("bfloat16", "ml_dtypes" in sys.modules)
"""


def run(code: str, *args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[:-1]


def test_weightstore_and_files_of_numpy_dtypes_do_not_import_ml_dtypes(tmp_path):
    assert run(SCRIPT, str(tmp_path)) == ["import False", "plain False"]


def test_the_cli_does_not_import_ml_dtypes(tmp_path):
    """``ws ls`` of a float32 file, run as the ``ws`` script runs it."""
    import numpy as np

    import weightstore as ws

    ws.save(tmp_path / "plain.safetensors", {"a": np.ones(3, np.float32)})
    code = ("import sys; from weightstore.cli.main import main; sys.argv = ['ws', 'ls', sys.argv[1]]\n"
            "try: main()\nexcept SystemExit: pass\nprint('ml_dtypes' in sys.modules)")
    lines = run(code, str(tmp_path / "plain.safetensors"))
    assert any("float32" in line for line in lines) and lines[-1] == "False", lines


def test_a_bfloat16_file_read_in_a_fresh_process_imports_it(tmp_path):
    import ml_dtypes
    import numpy as np

    import weightstore as ws

    for name in ("bf.npz", "bf.safetensors"):
        ws.save(tmp_path / name, {"w": np.array([1.0, -2.5, 3.0], ml_dtypes.bfloat16)})
    assert run(BFLOAT16, str(tmp_path)) == ["bfloat16 True"]
