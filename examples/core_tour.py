"""The core in one minute: save a weight dictionary, list it without reading it, load a part.

Run: ``python -m examples.core_tour``
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

import weightstore as ws


def main(folder: str | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    weights = {
        "conv_1/kernel": rng.standard_normal((3, 3, 3, 16), dtype=np.float32),
        "conv_1/bn/gamma": np.ones(16, np.float32),
        "conv_1/bn/moving_mean": np.zeros(16, np.float32),
        "dense/kernel": rng.standard_normal((256, 10), dtype=np.float32),
        "dense/kernel/Adagrad": np.full((256, 10), 0.1, np.float32),  # an optimizer slot
        "dense/bias": np.zeros(10, np.float32),
    }
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(folder or scratch)
        for name in ("weights.npz", "weights.h5"):
            path = root / name
            ws.save(path, weights, metadata={"step": 1000})
            with ws.open(path) as store:  # reads the index only
                print(f"{name}: {len(store)} tensors, {store.nbytes} bytes, metadata {store.metadata}")
                for key in store:
                    info = store.info(key)
                    print(f"  {key:<24} {info.dtype:<8} {str(info.shape):<16} {info.checksum}")
        head = ws.load(root / "weights.npz", include="dense", exclude="*/Adagrad")
        print("selective load of 'dense' without optimizer slots:", sorted(head))
        under = ws.remap(head, scope="model_002")
        print("the same, put under scope model_002:", sorted(under))
        return head


if __name__ == "__main__":
    main()
