"""Serve a TF1-trained model with PyTorch, in a process that never imports TensorFlow.

A TF1 graph trains a few steps: two dense layers written with ``variable_scope`` and
``get_variable``, named as TF1's ``layers.dense`` names them (``hidden/kernel``,
``hidden/bias``, ``logits/kernel``, ``logits/bias``). ``tf.compat.v1.train.Saver`` saves it
as ``ckpt/model.ckpt-<step>``, next to its predictions on fixed inputs. That happens in a
child process, as a trainer would. This process then reads the checkpoint with ``ws.load``
(weightstore parses TF's bundle format itself), assigns it to an equivalent
``torch.nn.Module`` with ``layout="keras"`` (TF1's dense kernels are ``[in, out]``,
``nn.Linear`` wants ``[out, in]``), and compares predictions, without TensorFlow loaded.

Run: ``python -m examples.tf1_to_torch``
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import weightstore as ws

STEP = 20
FEATURES, HIDDEN, CLASSES = 6, 16, 3


def inputs() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(8, FEATURES)).astype(np.float32)


def train_and_save(folder: Path) -> None:
    """The trainer's side (imports TensorFlow): a few steps of training, a Saver checkpoint, predictions."""
    import tensorflow as tf

    v1 = tf.compat.v1
    with tf.Graph().as_default() as graph:  # a TF1 graph without switching the whole process out of eager mode
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [None, FEATURES])
        labels = v1.placeholder(tf.int64, [None])
        hidden = tf.nn.relu(_dense(x, FEATURES, HIDDEN, "hidden"))
        logits = _dense(hidden, HIDDEN, CLASSES, "logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        saver, initialize = v1.train.Saver(), v1.global_variables_initializer()
    rng = np.random.default_rng(1)
    with v1.Session(graph=graph) as sess:
        sess.run(initialize)
        for _ in range(STEP):
            sess.run(train, {x: rng.normal(size=(32, FEATURES)), labels: rng.integers(0, CLASSES, 32)})
        saver.save(sess, str(folder / "ckpt" / "model.ckpt"), global_step=STEP)
        np.save(folder / "expected.npy", sess.run(logits, {x: inputs()}))


def _dense(x, inputs: int, outputs: int, name: str):
    import tensorflow as tf

    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable("kernel", [inputs, outputs])
        bias = tf.compat.v1.get_variable("bias", [outputs], initializer=tf.compat.v1.random_normal_initializer())
    return x @ kernel + bias


def build_torch():
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = nn.Linear(FEATURES, HIDDEN)
            self.logits = nn.Linear(HIDDEN, CLASSES)

        def forward(self, x):
            return self.logits(self.hidden(x).relu())

    return Net().eval()


def serve(folder: Path) -> dict:
    """The serving side (no TensorFlow): read the checkpoint, assign it to PyTorch, compare predictions."""
    import torch

    from weightstore.adapters import torch as torch_adapter

    weights = ws.load(folder / "ckpt" / f"model.ckpt-{STEP}")
    net = build_torch()
    report = torch_adapter.assign(net, weights, layout="keras")
    with torch.no_grad():
        served = net(torch.from_numpy(inputs())).numpy()
    difference = float(np.max(np.abs(served - np.load(folder / "expected.npy"))))
    tensorflow_loaded = sys.modules.get("tensorflow") is not None  # None: a blocked import
    print(f"read {len(weights)} tensors from model.ckpt-{STEP}: {sorted(weights)}")
    print(f"PyTorch predictions vs TF1's: max abs difference {difference:.2e}; "
          f"TensorFlow imported in this process: {tensorflow_loaded}")
    return {"difference": difference, "assigned": sorted(report.assigned), "tensorflow_loaded": tensorflow_loaded}


def main(folder: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(folder or scratch)
        subprocess.run([sys.executable, "-m", "examples.tf1_to_torch", "--train", str(root)], check=True)
        return serve(root)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        train_and_save(Path(sys.argv[2]))
    else:
        main()
