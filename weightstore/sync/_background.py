"""Publish from a training loop without waiting for the write.

:class:`BackgroundPublisher` hands each publish to a thread and returns at once, so the
training thread is held only for as long as it takes to give it the weights. The weights may
be numpy arrays, or framework tensors that are converted to numpy on the publishing thread,
one at a time as each is written (``weightstore.adapters.serving.snapshot`` takes such tensors from a
TF model without copying them).

**At most one publish in flight.** A publish while the previous one is still writing first
waits for it, as TensorFlow's async checkpoint does: queueing more would hold one more copy of
the model per queued publish, and dropping one would lose a version the caller asked for. So a
trainer that publishes faster than the folder takes them is slowed down to the folder's pace.

**Errors are never lost.** A failed publish raises its exception, once, from the first of: the
next :meth:`~BackgroundPublisher.publish`, :meth:`~BackgroundPublisher.wait` or
:meth:`~BackgroundPublisher.close`; unless the caller already saw it through the future's
``result()`` or ``exception()``. The version files stay as crash-safe as :func:`weightstore.publish`
makes them, since each publish is exactly one call to it: a process that exits normally first
waits for the publish in flight (the thread is not a daemon), and one killed mid-write leaves
the folder as a killed ``publish`` does, with the previous version intact. Only ``close()``
(or leaving a ``with`` block) can still hand the last publish's error to you.

Example::

    with ws.BackgroundPublisher("runs/a", keep=3) as publisher:
        for step in range(1, 1001):
            train_step()
            if step % 100 == 0:
                publisher.publish(weights(), step=step)
    # every publish is complete here, or ``with`` raised the first unreported error
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from weightstore.errors import PublishError
from weightstore.formats import format_named
from weightstore.store._save import checked_metadata
from weightstore.sync._versions import (
    DEFAULT_FORMAT,
    DEFAULT_KEEP,
    PublishOptions,
    Version,
    checked_keep,
    checked_step,
    publish,
)

__all__ = ["BackgroundPublisher", "PublishFuture"]


class PublishFuture(concurrent.futures.Future):
    """One background publish: ``result()`` waits for it and returns its :class:`Version`, or raises.

    An error the caller saw here (through ``result()`` or ``exception()``) is not raised again
    by the publisher.
    """

    _seen = False

    def result(self, timeout: float | None = None) -> Version:
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            raise
        except BaseException:
            self._seen = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        if error is not None:
            self._seen = True
        return error


class BackgroundPublisher:
    """Publish versions of ``folder`` on a background thread, at most one at a time.

    The options are those of :func:`weightstore.publish`; ``metadata`` is merged under each
    publish's own. A context manager: leaving the block waits for the last publish and
    raises an error no one has seen yet. Call it from one thread (the training loop).
    """

    def __init__(
        self,
        folder: Any,
        *,
        keep: int | None = DEFAULT_KEEP,
        metadata: Mapping[str, Any] | None = None,
        format: str = DEFAULT_FORMAT,  # noqa: A002
        storage_options: Mapping[str, Any] | None = None,
    ):
        keep = checked_keep(keep)
        format_named(format)  # an unknown format fails here, not on the first background publish
        self.folder = folder
        self.metadata = checked_metadata(metadata, str(folder))
        self._options = PublishOptions(keep=keep, format=format, storage_options=storage_options)
        self._pending: PublishFuture | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.last: Version | None = None
        """The last version this publisher completed."""

    def publish(self, weights: Mapping[str, Any], *, step: int,
                metadata: Mapping[str, Any] | None = None) -> PublishFuture:
        """Start publishing ``weights`` as version ``step`` and return at once.

        Waits first for a publish still in flight, and raises its error if it failed and
        nobody saw it (then ``weights`` are not published). ``weights`` must not change until
        the returned future is done: the caller hands over arrays it will not write to, or
        tensors whose framework copies on write (a TF snapshot). From a plain ``dict`` the
        publisher lets go of each value as soon as it is written, so a snapshot nobody else
        holds is freed tensor by tensor rather than at the end.
        """
        if self._closed:
            raise PublishError("this BackgroundPublisher is closed", path=str(self.folder))
        step = checked_step(step)  # here, not on the thread: a bad step must not cost the next publish
        self.wait()
        future = PublishFuture()
        future.set_running_or_notify_cancel()
        merged = {**self.metadata, **dict(metadata or {})}
        self._pending = future
        handed = _handed_over(weights) if type(weights) is dict else weights
        self._thread = threading.Thread(target=self._run, args=(future, handed, step, merged),
                                        name=f"weightstore-publish-{step}")
        self._thread.start()
        return future

    def _run(self, future: PublishFuture, weights: Mapping[str, Any], step: int, metadata: dict[str, Any]) -> None:
        try:
            version = publish(self.folder, weights, step=step, metadata=metadata, **self._options)
        except BaseException as exc:  # handed to whoever waits next, never lost in this thread
            future.set_exception(exc)
        else:
            self.last = version
            future.set_result(version)

    @property
    def busy(self) -> bool:
        """Whether a publish is in flight now."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> Version | None:
        """Wait for the publish in flight; return the last version, or raise its unseen error."""
        pending, thread = self._pending, self._thread
        if pending is None:
            return self.last
        error = pending.exception() if not pending._seen else None  # waits; marks the error seen
        if thread is not None:
            thread.join()  # the thread has let go of the weights too
        self._pending = self._thread = None
        if error is not None:
            raise error
        return self.last

    def close(self) -> Version | None:
        """Wait for the last publish and refuse further ones; raises an error nobody has seen."""
        self._closed = True
        return self.wait()

    def __enter__(self) -> BackgroundPublisher:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        self._closed = True
        try:
            self.wait()
        except Exception as error:
            if exc is None:
                raise
            note = f"and a background publish to {self.folder} failed too: {error!r}"
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(note)
            else:  # pragma: no cover - Python 3.10
                warnings.warn(note, RuntimeWarning, stacklevel=2)


def _handed_over(weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` with each array-like value wrapped so that the writer drops it once written."""
    return {key: _Once(value) if hasattr(value, "__array__") and hasattr(value, "dtype") else value
            for key, value in weights.items()}


class _Once:
    """An array-like the writer converts exactly once, after which this holds no reference to it.

    While training goes on, every tensor of a snapshot that is still referenced costs a copy
    (TF copies a variable's buffer on write while a snapshot shares it); dropping each one as
    soon as it is written keeps that to the tensors not yet written.
    """

    __slots__ = ("_value", "dtype", "shape")

    def __init__(self, value: Any):
        self._value = value
        # checked and planned before the write without converting (see saving.CheckedWeights)
        self.dtype, self.shape = value.dtype, getattr(value, "shape", None)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value, self._value = self._value, None
        if value is None:
            raise RuntimeError("a snapshot value was converted twice; the publisher hands each one over once")
        return np.asarray(value) if dtype is None else np.asarray(value, dtype=dtype)
