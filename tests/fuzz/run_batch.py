"""``python -m fuzz.run_batch TARGET SEED COUNT FOLDER`` (from ``tests/``): one seeded batch.

Run in a subprocess by ``tests/test_fuzz.py`` for targets whose library may crash the process
(HDF5): the mutant being read is on disk, and named on stdout, before each read, so a
SIGSEGV is reported with the file that caused it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fuzz.targets import Finding, fuzz_batch

if __name__ == "__main__":
    name, seed, count, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    try:
        print("OUTCOMES", fuzz_batch(name, seed, count, folder, log=sys.stdout), flush=True)
    except Finding as finding:
        print("FINDING", finding, flush=True)
        sys.exit(1)
