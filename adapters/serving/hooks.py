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
one at a time, a newer snapshot replacing one still waiting. On either thread, a full version
whose every weight changed since the last (a trainer's) is written without content digests,
which no follower could match (:class:`~weightstore.store._save.DigestsSince`, one per hook).

**A publish never costs the run.** No publish's failure is raised into the training loop, in
the background or not: storage failures are retried with backoff (in the background), every
failure is logged and counted (``failures``, ``last_error``). The end of training (Keras
``on_train_end``, the hook's ``end``) publishes the final weights, unless the last publish
already holds them, and waits for them at most ``end_timeout`` seconds; then it logs which
version is the last published, and a publish still retrying goes on in the background, for
``retry_for`` seconds at most (the process waits for it at exit: a short ``retry_for`` lets a
script end soon during an outage, at the cost of the final weights).

Under tf.distribute (or a ``TF_CONFIG`` cluster) only the chief publishes: the task of type
``chief``, or worker 0 when the cluster has no chief. Every worker holds the same weights, and
one publisher per folder is the rule :mod:`weightstore.sync._publish` enforces.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from typing_extensions import Unpack

from weightstore.core._extras import needs

with needs("tf", __name__):
    import keras
    import tensorflow as tf

from weightstore.adapters.plan import Selection, SelectionWords
from weightstore.sharded._cluster import is_tf_chief, tf_config_task
from weightstore.store._save import DigestsSince
from weightstore.sync._background import DEFAULT_RETRY_FOR, BackgroundPublisher
from weightstore.sync._checks import checked_seconds
from weightstore.sync._defaults import DEFAULT_FORMAT, DEFAULT_KEEP
from weightstore.sync._delta import Delta
from weightstore.sync._pinning import Version
from weightstore.sync._publish import PublishOptions, publish_digested

__all__ = ["PublishCallback", "PublishHook", "is_chief"]

#: how long the end of training waits for its final publish before it lets training return
DEFAULT_END_TIMEOUT = 60.0
_log = logging.getLogger("weightstore")


def is_chief(strategy: Any = None) -> bool:
    """Whether this task publishes: the one :func:`weightstore.sharded.is_tf_chief` names (the
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
                 selection: Selection, storage_options: Mapping[str, Any] | None, background: bool,
                 end_timeout: float, delta: bool | Delta = False, retry_for: float = DEFAULT_RETRY_FOR):
        self.folder = folder
        self.selection = selection
        self.options = PublishOptions(keep=keep, format=format, storage_options=storage_options)
        self.metadata = dict(metadata or {})
        self.end_timeout = checked_seconds("end_timeout", end_timeout)
        retry_for = checked_seconds("retry_for", retry_for)  # a bad one fails here, whether it is used or not
        #: one for the hook's life, kept by the background publisher when there is one
        self.delta: Delta | None = None if background or not delta else (Delta() if delta is True else delta)
        #: on the training thread, as the background publisher does: a trainer's versions, each
        #: weight changed since the last, are written without the digests none could match
        self._digests = DigestsSince()
        self.background = (BackgroundPublisher(folder, **self.options, metadata=metadata, delta=delta,
                                               retry_for=retry_for) if background else None)
        self._last: Version | None = None
        self._failures = 0
        self._error: BaseException | None = None
        self._step: int | None = None  # the last step handed over, finished or not

    @property
    def last(self) -> Version | None:
        return self._last if self.background is None else self.background.last

    @property
    def failures(self) -> int:
        return self._failures + (self.background.failures if self.background is not None else 0)

    @property
    def last_error(self) -> BaseException | None:
        background = self.background.last_error if self.background is not None else None
        return background or self._error

    def publish(self, read: Callable[[], Mapping[str, Any]], step: int, extra: Mapping[str, Any]) -> None:
        """Publish what ``read()`` returns as ``step`` (in the background: handed over); never raises,
        the snapshot's own failure included."""
        if self._step is not None and step <= self._step:
            if step < self._step:  # a recompiled optimizer counts from 0 again: nothing is published
                _log.warning("not publishing step %d to %s: step %d was published before, and steps must increase "
                             "(the optimizer's iterations started over?)", step, self.folder, self._step)
            return  # equal: this step is out already (a batch and an epoch trigger at once)
        try:
            if self.background is not None:
                self.background.publish(read(), step=step, metadata=extra)
            else:
                self._last = publish_digested(self.folder, read(), step=step, metadata={**self.metadata, **extra},
                                              delta=self.delta or False, digests=self._digests, **self.options)
        except Exception as error:  # a copy of the weights must not end the training it copies
            self._failures += 1
            self._error = error
            _log.error("publishing step %d to %s failed: %s; the last version published is %s", step,
                       self.folder, error, self.last.step if self.last else "none")
            return
        self._step = step

    def wait(self, timeout: float | None = None) -> Version | None:
        return self.last if self.background is None else self.background.wait(timeout)

    def close(self, timeout: float | None = None) -> Version | None:
        return self.last if self.background is None else self.background.close(timeout)

    def end(self) -> None:
        """At the end of training: wait for the final publish a bounded time, and say where it stands."""
        last = self.wait(self.end_timeout)
        if self._step is not None and (last is None or last.step != self._step):
            _log.warning("training ended: the final weights (step %d) are not published to %s yet; the last version "
                         "published is %s", self._step, self.folder, last.step if last else "none")


class _Front:
    """The members both hooks show their user, answered by the :class:`_Publisher` behind them."""

    _publisher: _Publisher

    @property
    def last(self) -> Version | None:
        """The last version published (completed), or ``None``."""
        return self._publisher.last

    @property
    def failures(self) -> int:
        """How many publish attempts failed; none of them reached the training loop."""
        return self._publisher.failures

    @property
    def last_error(self) -> BaseException | None:
        """The error of the last failed publish attempt, or ``None``."""
        return self._publisher.last_error

    def wait(self, timeout: float | None = None) -> Version | None:
        """Wait (at most ``timeout`` seconds) for what was handed over; return the last version published."""
        return self._publisher.wait(timeout)

    def close(self, timeout: float | None = None) -> Version | None:
        """Wait like :meth:`wait`, then refuse further publishes."""
        return self._publisher.close(timeout)


class PublishCallback(_Front, keras.callbacks.Callback):
    """Publish the model's weights to ``folder`` every ``every_n_batches`` and/or ``every_n_epochs``,
    and at the end of ``fit``.

    With neither given, publishes after every epoch. Batches are counted as Keras's own
    ``ModelCheckpoint(save_freq=N)`` counts them: under ``compile(steps_per_execution=K)`` Keras
    reports every K-th batch, and the callback publishes at the first report at or past N
    batches since its last publish. The end of ``fit`` publishes the final weights
    (``at_end=False``: not), so a follower of a finished run ends on exactly the trained
    model. The step is ``model.optimizer.iterations``; the metadata gets ``{"epoch": ...}`` on
    top of ``metadata``. ``scope``/``include``/``exclude``/``trainable_only``/``also`` select as
    in ``tf2.export``.

    No publish's failure reaches ``fit`` (see the module): ``failures`` counts them,
    ``last_error`` holds the last, ``last`` is the last version completed. The end of ``fit``
    waits at most ``end_timeout`` seconds for the final publish; a failing storage is retried for
    ``retry_for`` seconds at most (in the background). Outside ``fit``, :meth:`wait`
    and :meth:`close` wait for what was handed over. ``delta=True`` publishes delta versions
    (see :class:`weightstore.Delta`: a copy of the last version is kept, 1x the model's memory).
    """

    def __init__(self, folder: Any, *, every_n_batches: int | None = None, every_n_epochs: int | None = None,
                 at_end: bool = True, keep: int | None = DEFAULT_KEEP, metadata: Mapping[str, Any] | None = None,
                 format: str = DEFAULT_FORMAT,  # noqa: A002
                 storage_options: Mapping[str, Any] | None = None, background: bool = True,
                 end_timeout: float = DEFAULT_END_TIMEOUT, delta: bool | Delta = False,
                 retry_for: float = DEFAULT_RETRY_FOR, **selection: Unpack[SelectionWords]):
        super().__init__()
        if every_n_batches is None and every_n_epochs is None:
            every_n_epochs = 1
        for name, value in (("every_n_batches", every_n_batches), ("every_n_epochs", every_n_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int of at least 1, not {value!r}")
        self.every_n_batches, self.every_n_epochs, self.at_end = every_n_batches, every_n_epochs, at_end
        self._publisher = _Publisher(folder, keep=keep, metadata=metadata, format=format,
                                     selection=Selection.of("PublishCallback", selection, PublishCallback), storage_options=storage_options,
                                     background=background, end_timeout=end_timeout, delta=delta,
                                     retry_for=retry_for)
        self._batches_since = 0  # batches since the last publish, as ModelCheckpoint counts them
        self._last_batch: int | None = None
        self._epoch = 0

    def on_train_begin(self, logs: Any = None) -> None:
        self._warn_when_only_the_end_publishes(self.params or {})

    def on_train_end(self, logs: Any = None) -> None:
        if self.at_end:
            self._publish()
        self._publisher.end()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self.every_n_batches:
            return
        # Keras reports the last batch of each execution: count the batches it stands for
        seen = batch + 1 if self._last_batch is None or batch <= self._last_batch else batch - self._last_batch
        self._last_batch = batch
        self._batches_since += seen
        if self._batches_since >= self.every_n_batches:
            self._batches_since = 0
            self._publish()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0:
            self._publish()

    def _warn_when_only_the_end_publishes(self, params: Mapping[str, Any]) -> None:
        """Say so when no interval can trigger within this ``fit``: only its end publishes, or,
        with ``at_end=False``, nothing does."""
        epochs, steps = params.get("epochs"), params.get("steps")
        by_epoch = self.every_n_epochs is not None and epochs is not None and self.every_n_epochs > epochs
        by_batch = self.every_n_batches is not None and epochs is not None and steps is not None and \
            self.every_n_batches > epochs * steps
        if (by_epoch or self.every_n_epochs is None) and (by_batch or self.every_n_batches is None):
            what = "only the end of fit publishes" if self.at_end else "nothing is published (at_end=False)"
            warnings.warn(f"PublishCallback(every_n_batches={self.every_n_batches}, every_n_epochs="
                          f"{self.every_n_epochs}) never triggers in a fit of {epochs} epochs of {steps} steps: "
                          f"{what}", UserWarning, stacklevel=2)

    def _publish(self) -> None:
        if not is_chief(getattr(self.model, "distribute_strategy", None)):
            return
        from weightstore.adapters.serving.snapshot import snapshot

        optimizer = getattr(self.model, "optimizer", None)
        step = int(optimizer.iterations.numpy()) if optimizer is not None else self._epoch
        selection = self._publisher.selection.words()
        self._publisher.publish(lambda: snapshot(self.model, **selection), step, {"epoch": self._epoch})


class PublishHook(_Front, tf.compat.v1.train.SessionRunHook):
    """Publish a TF1 graph's variables to ``folder`` every N steps or seconds, and at the end.

    The step is the global step, which must exist (``tf.compat.v1.train.get_or_create_global_step()``).
    ``is_chief`` defaults to what ``TF_CONFIG`` says; pass the value you give
    ``MonitoredTrainingSession(is_chief=...)`` to be explicit. Export reads variables with no new
    ops, so the finalized graph of a ``MonitoredTrainingSession`` is fine.

    With ``background`` (the default) the values are fetched on the training thread and
    written while training goes on; ``end`` (when the session closes) publishes the final step
    and waits for it at most ``end_timeout`` seconds; a failing storage is retried for
    ``retry_for`` seconds at most. No publish's failure reaches the session
    (see the module): ``failures`` counts them and ``last_error`` holds the last. ``delta=True``
    publishes delta versions (see :class:`weightstore.Delta`: a copy of the last version is
    kept, 1x the model's memory).
    """

    def __init__(self, folder: Any, *, every_n_steps: int | None = None, every_n_secs: float | None = None,
                 keep: int | None = DEFAULT_KEEP, metadata: Mapping[str, Any] | None = None,
                 format: str = DEFAULT_FORMAT,  # noqa: A002
                 storage_options: Mapping[str, Any] | None = None, is_chief: bool | None = None,
                 background: bool = True, end_timeout: float = DEFAULT_END_TIMEOUT,
                 delta: bool | Delta = False, retry_for: float = DEFAULT_RETRY_FOR,
                 **selection: Unpack[SelectionWords]):
        if (every_n_steps is None) == (every_n_secs is None):
            raise ValueError("pass exactly one of every_n_steps and every_n_secs")
        self._timer = tf.compat.v1.train.SecondOrStepTimer(every_secs=every_n_secs, every_steps=every_n_steps)
        self._publisher = _Publisher(folder, keep=keep, metadata=metadata, format=format,
                                     selection=Selection.of("PublishHook", selection, PublishHook), storage_options=storage_options,
                                     background=background, end_timeout=end_timeout, delta=delta,
                                     retry_for=retry_for)
        self._is_chief = is_chief
        self._global_step: tf.Tensor | None = None

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
            self._publisher.end()

    def _publish(self, session: Any) -> None:
        from weightstore.adapters import tf1

        step = int(session.run(self._global_step))
        self._timer.update_last_triggered_step(step)
        self._publisher.publish(lambda: tf1.export(session, **self._publisher.selection.words()), step, {})
