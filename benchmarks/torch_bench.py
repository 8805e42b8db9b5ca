"""PyTorch restore: ``torch.assign`` against ``load_state_dict``, with and without a layout.

``python -m benchmarks.torch_bench [--size-mb N] [--repeat N]`` builds a stack of square
``nn.Linear`` layers of about N MB, saves it as npz, and prints the median seconds of:
``torch.assign`` from the file; ``ws.load`` then ``load_state_dict``; ``load_state_dict`` of
tensors already in memory (the floor); and ``torch.assign(layout="keras")`` of the Keras-layout
dictionary in memory, which transposes every kernel on the way in. One process, one run:
compare the ratios, not the seconds (the disk and the neighbours are noisy).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import median_seconds


def bench(size_mb: float, repeat: int) -> dict[str, float]:
    import torch

    import weightstore as ws
    from weightstore.adapters import torch as torch_adapter

    width = 2048
    layers = max(1, round(size_mb * (1 << 20) / (width * width * 4)))
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    in_memory = {key: value.clone() for key, value in net.state_dict().items()}
    keras_layout = torch_adapter.export(net, layout="keras")
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.npz"
        ws.save(path, torch_adapter.export(net))

        def load_then_state_dict() -> None:
            weights = ws.load(path)
            net.load_state_dict({key.replace("/", "."): torch.from_numpy(value) for key, value in weights.items()})

        results = {
            "torch.assign(path)": median_seconds(lambda: torch_adapter.assign(net, path), repeat),
            "ws.load + load_state_dict": median_seconds(load_then_state_dict, repeat),
            "load_state_dict (in memory)": median_seconds(lambda: net.load_state_dict(in_memory), repeat),
            "torch.assign(layout='keras') (in memory)": median_seconds(
                lambda: torch_adapter.assign(net, keras_layout, layout="keras"), repeat),
        }
    print(f"{layers} x Linear({width}, {width}), {size_mb:.0f} MB, median of {repeat}:")
    for name, seconds in results.items():
        print(f"  {name:42s} {seconds:7.3f} s")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_bench", description=__doc__)
    parser.add_argument("--size-mb", type=float, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    arguments = parser.parse_args()
    bench(arguments.size_mb, arguments.repeat)
