"""TensorFlow and Keras files as TensorFlow and Keras really write them, for tests.

Building graphs and Keras models is the slow part of these tests, so :func:`make_all` makes
every checkpoint once per test module (the ``made`` fixture in ``conftest.py``); tests change
only copies (:func:`copy_checkpoint`) under their own ``tmp_path``.
"""

from __future__ import annotations

import os
import shutil

import keras
import numpy as np
import tensorflow as tf


def make_tf1(folder, *, meta: bool = True):
    """A TF1 Saver checkpoint with Adam slots, a global step, a partitioned and a string variable."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.compat.v1.get_variable("model/dense/w", initializer=np.arange(6, dtype=np.float32).reshape(2, 3))
        b = tf.compat.v1.get_variable("model/dense/b", initializer=np.ones(3, np.float32))
        emb = tf.compat.v1.get_variable("model/emb", shape=[4, 2], partitioner=tf.compat.v1.fixed_size_partitioner(2))
        tf.compat.v1.get_variable("model/stats", initializer=np.zeros(3, np.float32), trainable=False)
        tf.Variable("a tag", name="tag", trainable=False)
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_sum(w * w) + tf.reduce_sum(b) + tf.reduce_sum(emb)
        train = tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train)
        prefix = tf.compat.v1.train.Saver().save(sess, str(folder / "model.ckpt"), global_step=step,
                                                 write_meta_graph=meta)
    return prefix


class Net(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.arange(4, dtype=np.float32).reshape(2, 2), name="w")
        self.b = tf.Variable(np.zeros(2, np.float32), name="b")


def make_tf2_module(folder):
    """A tf.train.Checkpoint of a tf.Module with a compat.v1 Adam: slot variables and bookkeeping."""
    net, opt = Net(), tf.compat.v1.train.AdamOptimizer(0.1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(net.w * net.w) + tf.reduce_sum(net.b)
    opt.apply_gradients(zip(tape.gradient(loss, [net.w, net.b]), [net.w, net.b], strict=True))
    return tf.train.Checkpoint(net=net, opt=opt).save(str(folder / "ckpt")), net


def make_keras(folder):
    """A trained Keras model saved as .weights.h5, .keras and a TF2 checkpoint with its optimizer."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d1"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(2, name="d2")])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 3), np.float32), np.ones((8, 2), np.float32), verbose=0, epochs=1)
    model.save_weights(str(folder / "model.weights.h5"))
    model.save(str(folder / "model.keras"))
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(folder / "tf2" / "ckpt"))
    return model, prefix


def make_all(root):
    """Every checkpoint above, made under ``root``, by name (what the ``made`` fixture holds)."""
    (root / "tf1").mkdir(), (root / "tf1_nometa").mkdir(), (root / "module").mkdir()
    model, keras_prefix = make_keras(root)
    module_prefix, net = make_tf2_module(root / "module")
    return {
        "root": root,
        "tf1": make_tf1(root / "tf1"),
        "tf1_nometa": make_tf1(root / "tf1_nometa", meta=False),
        "module": module_prefix,
        "net": {"net/w": net.w.numpy(), "net/b": net.b.numpy()},
        "keras_ckpt": keras_prefix,
        "model": model,
    }


def restore_with_saver(prefix, shapes):
    """Values TF1's own Saver restores into fresh variables named by ``shapes``' keys."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        variables = {k: tf.compat.v1.get_variable(k, shape=s, dtype=tf.float32) for k, s in shapes.items()}
        tf.compat.v1.train.Saver(variables).restore(sess, prefix)
        return {k: sess.run(v) for k, v in variables.items()}


def copy_checkpoint(prefix, folder):
    """A copy of the checkpoint at ``prefix`` in ``folder``, so a test may change it."""
    base = os.path.basename(prefix)
    for name in os.listdir(os.path.dirname(prefix)):
        if name.startswith(base + "."):
            shutil.copy(os.path.join(os.path.dirname(prefix), name), folder / name)
    return str(folder / base)


def same_architecture():
    """A fresh model shaped like ``make_keras``'s, to restore a TF2 checkpoint into."""
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d1"),
                             keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(2, name="d2")])
