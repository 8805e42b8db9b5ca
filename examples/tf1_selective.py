"""Selective save and restore: keep what predictions need, leave optimizer state behind.

A small conv net with batch norm trains a few steps with Adagrad. What inference needs is the
trainable variables plus the batch-norm moving statistics (not trainable, so
``trainable_only`` alone would lose them); the Adagrad slots and the step counter stay out.
A fresh training graph restores that file strictly: ``tf1.assign`` leaves the graph's own
training state (the slots, the step counter) out unless ``optimizer=True``, so those keep
their initial values, and predictions match the trained graph's exactly.

Run: ``python -m examples.tf1_selective``
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

import weightstore as ws

BATCH_NORM = ["conv_1/bn", "conv_2/bn"]


def build(images, labels):
    """Two conv blocks with batch norm and a dense head; returns (train op, eval predictions)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    train_x, eval_x, updates = images, images, []
    for name, channels in (("conv_1", 8), ("conv_2", 16)):
        with v1.variable_scope(name):
            kernel = v1.get_variable("kernel", [3, 3, train_x.shape[-1], channels])
            train_x, eval_x, update = _conv_bn(train_x, eval_x, kernel)
            updates += update
    with v1.variable_scope("dense"):
        w = v1.get_variable("kernel", [16, 3])
        b = v1.get_variable("bias", [3], initializer=v1.zeros_initializer())
    train_logits = tf.reduce_mean(train_x, axis=[1, 2]) @ w + b
    eval_logits = tf.reduce_mean(eval_x, axis=[1, 2]) @ w + b
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=train_logits))
    step = v1.train.get_or_create_global_step()
    with tf.control_dependencies(updates):
        v1.logging.set_verbosity(v1.logging.ERROR)  # Adagrad's own deprecation notice is not ours to show
        train = v1.train.AdagradOptimizer(0.1).minimize(loss, global_step=step)
    return train, tf.nn.softmax(eval_logits)


def _conv_bn(train_x, eval_x, kernel, momentum=0.9):
    """Convolution, then batch norm: batch statistics in training, moving ones in evaluation."""
    import tensorflow as tf

    v1 = tf.compat.v1
    channels = kernel.shape[-1]
    with v1.variable_scope("bn"):
        beta = v1.get_variable("beta", [channels], initializer=v1.zeros_initializer())
        gamma = v1.get_variable("gamma", [channels], initializer=v1.ones_initializer())
        mean = v1.get_variable("moving_mean", [channels], initializer=v1.zeros_initializer(), trainable=False)
        var = v1.get_variable("moving_variance", [channels], initializer=v1.ones_initializer(), trainable=False)
    outputs = []
    for x, training in ((train_x, True), (eval_x, False)):
        x = tf.nn.conv2d(x, kernel, strides=1, padding="SAME")
        if training:
            batch_mean, batch_var = tf.nn.moments(x, axes=[0, 1, 2])
            updates = [v1.assign(mean, momentum * mean + (1 - momentum) * batch_mean),
                       v1.assign(var, momentum * var + (1 - momentum) * batch_var)]
            x = tf.nn.batch_normalization(x, batch_mean, batch_var, beta, gamma, 1e-3)
        else:
            x = tf.nn.batch_normalization(x, mean, var, beta, gamma, 1e-3)
        outputs.append(tf.nn.relu(x))
    return outputs[0], outputs[1], updates


def main(folder: str | None = None) -> dict:
    import tensorflow as tf

    from weightstore.adapters import tf1

    v1 = tf.compat.v1
    rng = np.random.default_rng(0)
    data = rng.standard_normal((32, 8, 8, 1)).astype(np.float32)
    labels = rng.integers(0, 3, 32)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(folder or scratch)
        with tf.Graph().as_default(), v1.Session() as sess:
            v1.set_random_seed(1)
            train, predict = build(tf.constant(data), tf.constant(labels))
            sess.run(v1.global_variables_initializer())
            for _ in range(5):
                sess.run(train)
            trained = sess.run(predict)
            everything = tf1.export(sess)
            selected = {**tf1.export(sess, trainable_only=True),
                        **tf1.export(sess, include=BATCH_NORM, exclude="*/Adagrad")}
        ws.save(root / "everything.npz", everything)
        ws.save(root / "selected.npz", selected)
        sizes = {name: os.path.getsize(root / f"{name}.npz") for name in ("everything", "selected")}
        ratio = sizes["selected"] / sizes["everything"]
        print(f"everything: {len(everything)} tensors, {sizes['everything']} bytes")
        print(f"selected:   {len(selected)} tensors, {sizes['selected']} bytes ({ratio:.0%}); left out: "
              f"{sorted(set(everything) - set(selected))}")

        with tf.Graph().as_default(), v1.Session() as sess:
            v1.set_random_seed(2)  # a different initialisation, overwritten where the file says
            train, predict = build(tf.constant(data), tf.constant(labels))
            sess.run(v1.global_variables_initializer())
            initial = tf1.export(sess)
            report = tf1.assign(sess, root / "selected.npz")
            restored = sess.run(predict)
            after = tf1.export(sess)
        untouched = sorted(set(initial) - set(report.assigned))
        kept = all(np.array_equal(after[key], initial[key]) for key in untouched)
        same = bool(np.array_equal(restored, trained))
        print(f"restored {len(report.assigned)} tensors; {len(untouched)} kept their initial values: {kept}")
        print(f"predictions identical to the trained graph's: {same}")
    return {"ratio": ratio, "identical": same, "kept_initial": kept, "untouched": untouched,
            "left_out": sorted(set(everything) - set(selected))}


if __name__ == "__main__":
    main()
