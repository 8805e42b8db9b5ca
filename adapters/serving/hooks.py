"""Publish versions from the training loops people already run.

:class:`PublishCallback` is a Keras callback (``model.fit(..., callbacks=[...])``) and
:class:`PublishHook` a TF1 ``SessionRunHook`` for ``MonitoredTrainingSession``. Both export
the weights through the adapters and hand them to :func:`weightstore.publish`; the step is the
training step (the optimizer's ``iterations``, or the global step), so a resumed run keeps
counting where it left off and the "steps must increase" rule holds across restarts.

Both publish in the background by default (``background=False`` writes on the training
thread instead). The training thread is held only for a snapshot: the Keras callback reads
each variable as an eager tensor that shares the variable's buffer, which TensorFlow copies on
the next write to it (see :mod:`weightstore.adapters.serving.snapshot`); the TF1 hook fetches the
values in one ``session.run``. A :class:`weightstore.BackgroundPublisher` then writes them:
at most one publish in flight (the next one waits for it), and a failed publish raises on the
next publish, at the end of training, or from ``wait()``/``close()``. The end of training
(Keras ``on_train_end``, the hook's ``end``) waits, so the last version is complete when
``fit`` returns or the session closes.

Under tf.distribute (or a ``TF_CONFIG`` cluster) only the chief publishes: the task of type
``chief``, or worker 0 when the cluster has no chief. Every worker holds the same weights, and
one publisher per folder is the rule :mod:`weightstore.sync._versions` enforces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from typing_extensions import Unpack

import weightstore
from weightstore.core._extras import needs

with needs("tf", __name__):
    import keras
    import tensorflow as tf

from weightstore.adapters.plan import Selection, SelectionWords
from weightstore.sharded._cluster import is_tf_chief, tf_config_task
from weightstore.sync._background import BackgroundPublisher
from weightstore.sync._versions import DEFAULT_FORMAT, DEFAULT_KEEP, PublishOptions, Version

__all__ = ["PublishCallback", "PublishHook", "is_chief"]


def is_chief(strategy: Any = None) -> bool:
    """Whether this task publishes: the one :func:`weightstore.sharded._cluster.is_tf_chief` names (the
    chief, else the master, else worker 0), as the strategy's cluster or ``TF_CONFIG`` says;
    with no cluster, the single process does."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is not None and resolver.task_type is not None:
        return is_tf_chief(resolver.cluster_spec().as_dict(), resolver.task_type, int(resolver.task_id or 0))
    found = tf_config_task()
    return found is None or is_tf_chief(*found)


class _Publisher:
    """What both hooks share: the folder, the publish options, the export selection, the thread."""

    def __init__(self, folder: Any, *, keep: int | None, metadata: Mapping[str, Any] | None, format: str,
                 selection: Selection, storage_options: Mapping[str, Any] | None, background: bool):
        self.folder = folder
        self.selection = selection
        self.options = PublishOptions(keep=keep, format=format, storage_options=storage_options)
        self.metadata = dict(metadata or {})
        self.background = BackgroundPublisher(folder, **self.options, metadata=metadata) if background else None
        self._last: Version | None = None
        self._step: int | None = None  # the last step handed over, finished or not

    @property
    def last(self) -> Version | None:
        return self._last if self.background is None else self.background.last

    def publish(self, read: Callable[[], Mapping[str, Any]], step: int, extra: Mapping[str, Any]) -> None:
        """Publish what ``read()`` returns as ``step``; in the background, after the one in flight."""
        if self._step is not None and step <= self._step:
            return  # this step is out already (e.g. a batch and an epoch trigger at once)
        if self.background is None:
            self._last = weightstore.publish(self.folder, read(), step=step, metadata={**self.metadata, **extra},
                                             **self.options)
        else:
            self.background.wait()  # before the snapshot: its error first, and never two snapshots held
            self.background.publish(read(), step=step, metadata=extra)
        self._step = step

    def wait(self) -> Version | None:
        return self.last if self.background is None else self.background.wait()

    def close(self) -> Version | None:
        return self.last if self.background is None else self.background.close()


class PublishCallback(keras.callbacks.Callback):
    """Publish the model's weights to ``folder`` every ``every_n_batches`` and/or ``every_n_epochs``.

    With neither given, publishes after every epoch. The step is ``model.optimizer.iterations``;
    the metadata gets ``{"epoch": ...}`` on top of ``metadata``. ``last`` is the last Version
    completed. ``scope``/``include``/``exclude``/``trainable_only``/``also`` select as in ``tf2.export``.

    With ``background`` (the default) each publish is written while training goes on; the end
    of ``fit`` waits for the last one and raises its error. Outside ``fit``, :meth:`wait`
    and :meth:`close` do the same.
    """

    def __init__(self, folder: Any, *, every_n_batches: int | None = None, every_n_epochs: int | None = None,
                 keep: int | None = DEFAULT_KEEP, metadata: Mapping[str, Any] | None = None,
                 format: str = DEFAULT_FORMAT,  # noqa: A002
                 storage_options: Mapping[str, Any] | None = None, background: bool = True,
                 **selection: Unpack[SelectionWords]):
        super().__init__()
        if every_n_batches is None and every_n_epochs is None:
            every_n_epochs = 1
        for name, value in (("every_n_batches", every_n_batches), ("every_n_epochs", every_n_epochs)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, not {value!r}")
        self.every_n_batches, self.every_n_epochs = every_n_batches, every_n_epochs
        self._publisher = _Publisher(folder, keep=keep, metadata=metadata, format=format,
                                     selection=Selection(**selection),
                                     storage_options=storage_options, background=background)
        self._batches = 0
        self._epoch = 0

    @property
    def last(self) -> Version | None:
        return self._publisher.last

    def wait(self) -> Version | None:
        """Wait for the publish in flight; return the last version or raise its error."""
        return self._publisher.wait()

    def close(self) -> Version | None:
        """Wait like :meth:`wait`, then refuse further publishes."""
        return self._publisher.close()

    def on_train_end(self, logs: Any = None) -> None:
        self._publisher.wait()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._batches += 1
        if self.every_n_batches and self._batches % self.every_n_batches == 0:
            self._publish()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self._publish()

    def _publish(self) -> None:
        if not is_chief(getattr(self.model, "distribute_strategy", None)):
            return
        from weightstore.adapters.serving.snapshot import snapshot

        optimizer = getattr(self.model, "optimizer", None)
        step = int(optimizer.iterations.numpy()) if optimizer is not None else self._batches
        selection = self._publisher.selection.words()
        self._publisher.publish(lambda: snapshot(self.model, **selection), step, {"epoch": self._epoch})


class PublishHook(tf.compat.v1.train.SessionRunHook):
    """Publish a TF1 graph's variables to ``folder`` every N steps or seconds, and at the end.

    The step is the global step, which must exist (``tf.compat.v1.train.get_or_create_global_step()``).
    ``is_chief`` defaults to what ``TF_CONFIG`` says; pass the value you give
    ``MonitoredTrainingSession(is_chief=...)`` to be explicit. Export reads variables with no new
    ops, so the finalized graph of a ``MonitoredTrainingSession`` is fine.

    With ``background`` (the default) the values are fetched on the training thread and
    written while training goes on; ``end`` (when the session closes) publishes the final step
    and waits for it, raising a publish's error. :meth:`wait` and :meth:`close` do the same.
    """

    def __init__(self, folder: Any, *, every_n_steps: int | None = None, every_n_secs: float | None = None,
                 keep: int | None = DEFAULT_KEEP, metadata: Mapping[str, Any] | None = None,
                 format: str = DEFAULT_FORMAT,  # noqa: A002
                 storage_options: Mapping[str, Any] | None = None, is_chief: bool | None = None,
                 background: bool = True, **selection: Unpack[SelectionWords]):
        if (every_n_steps is None) == (every_n_secs is None):
            raise ValueError("pass exactly one of every_n_steps and every_n_secs")
        self._timer = tf.compat.v1.train.SecondOrStepTimer(every_secs=every_n_secs, every_steps=every_n_steps)
        self._publisher = _Publisher(folder, keep=keep, metadata=metadata, format=format,
                                     selection=Selection(**selection),
                                     storage_options=storage_options, background=background)
        self._is_chief = is_chief
        self._global_step: tf.Tensor | None = None

    @property
    def last(self) -> Version | None:
        return self._publisher.last

    def wait(self) -> Version | None:
        """Wait for the publish in flight; return the last version or raise its error."""
        return self._publisher.wait()

    def close(self) -> Version | None:
        """Wait like :meth:`wait`, then refuse further publishes."""
        return self._publisher.close()

    def begin(self) -> None:
        self._global_step = tf.compat.v1.train.get_global_step()
        if self._global_step is None:
            raise RuntimeError("PublishHook needs a global step: call tf.compat.v1.train.get_or_create_global_step()")
        if self._is_chief is None:
            self._is_chief = is_chief()

    def after_run(self, run_context: Any, run_values: Any) -> None:
        # read the step after the run: fetched alongside the train op it may or may not
        # include that run's increment, which made publishes land a step early under load
        if self._is_chief and self._timer.should_trigger_for_step(int(run_context.session.run(self._global_step))):
            self._publish(run_context.session)

    def end(self, session: Any) -> None:
        if self._is_chief:
            self._publish(session)
            self._publisher.wait()

    def _publish(self, session: Any) -> None:
        from weightstore.adapters import tf1

        step = int(session.run(self._global_step))
        self._timer.update_last_triggered_step(step)
        self._publisher.publish(lambda: tf1.export(session, **self._publisher.selection.words()), step, {})
