"""Ensembles: three checkpoints saved with unscoped names, loaded side by side in one graph.

Each member was trained alone, so its file says ``w``. The ensemble graph holds one copy per
member under ``model_001``…``model_003``; ``assign(…, scope=…)`` puts each file's keys under
its member's scope, with no hand-written loop over variable names.

Run: ``python -m examples.tf1_ensemble``
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

import weightstore as ws

MEMBERS = 3


def build_member(x):
    """``y = x + w``, with ``w`` named relative to whatever scope the caller opened."""
    import tensorflow as tf

    return x + tf.compat.v1.get_variable("w", [], initializer=tf.compat.v1.zeros_initializer())


def main(folder: str | None = None) -> list[float]:
    import tensorflow as tf

    from weightstore.adapters import tf1
    from weightstore.errors import AssignmentError

    v1 = tf.compat.v1
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(folder or scratch)
        for i in range(1, MEMBERS + 1):  # each member "trained" alone: w = i, saved as "w"
            with tf.Graph().as_default(), v1.Session() as sess:
                w = v1.get_variable("w", [])
                tf1.assign(sess, {"w": np.float32(i)})
                ws.save(root / f"member_{i}.npz", tf1.export(sess))
                print(f"member_{i}.npz holds {sorted(ws.load(root / f'member_{i}.npz'))} = {sess.run(w)}")

        with tf.Graph().as_default(), v1.Session() as sess:
            x = v1.placeholder(tf.float32, [], name="x")
            outputs = []
            for i in range(1, MEMBERS + 1):
                with v1.variable_scope(f"model_{i:03d}"):
                    outputs.append(build_member(x))
            for i in range(1, MEMBERS + 1):
                report = tf1.assign(sess, root / f"member_{i}.npz", scope=f"model_{i:03d}")
                print(f"member_{i}.npz -> {report.assigned}")
            try:
                tf1.assign(sess, root / "member_2.npz", scope="model_02")
            except AssignmentError as error:
                print(f"a mistyped scope changes nothing and says why:\n{error}")
            results = [float(y) for y in sess.run(outputs, {x: 10.0})]
    print("x = 10 ->", ", ".join(f"{y:g}" for y in results))
    return results


if __name__ == "__main__":
    main()
