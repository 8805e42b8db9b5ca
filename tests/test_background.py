"""BackgroundPublisher: publish without waiting for the write, one in flight, errors never lost."""

import shutil
import threading
import weakref

import numpy as np
import pytest

import weightstore as ws
from weightstore.sync import _versions as versions


def weights(step: int) -> dict:
    return {"dense/kernel": np.full((3, 2), step, np.float32), "dense/bias": np.arange(2, dtype=np.int64) + step}


@pytest.fixture
def gate(monkeypatch):
    """Holds every publish at its "locked" stage until ``gate.set()`` (at most 60 s)."""
    opened = threading.Event()
    held = []

    def stage(name: str) -> None:
        if name == "locked":
            held.append(threading.current_thread())
            opened.wait(60)

    monkeypatch.setattr(versions, "_stage", stage)
    opened.held = held
    yield opened
    opened.set()


class Lazy:
    """An array-like (as framework tensors are) that records which thread converts it."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype
        self.converted_on: list[threading.Thread] = []

    def __array__(self, dtype=None, copy=None):
        self.converted_on.append(threading.current_thread())
        return self.array


def test_publish_returns_before_the_write_and_result_gives_the_version(tmp_path, gate):
    with ws.BackgroundPublisher(tmp_path, keep=None, metadata={"run": "a"}) as publisher:
        future = publisher.publish(weights(1), step=1, metadata={"epoch": 0})
        assert not future.done() and publisher.busy and ws.latest(tmp_path) is None
        gate.set()
        version = future.result()
        assert version.step == 1 and version.metadata == {"run": "a", "epoch": 0}
        assert publisher.last == version and not publisher.busy
    assert gate.held and gate.held[0] is not threading.current_thread()
    loaded = ws.load(ws.latest(tmp_path))
    for key, value in weights(1).items():
        np.testing.assert_array_equal(loaded[key], value)
        assert loaded[key].dtype == value.dtype


def test_a_publish_waits_for_the_one_in_flight(tmp_path, gate):
    publisher = ws.BackgroundPublisher(tmp_path, keep=None)
    first = publisher.publish(weights(1), step=1)
    started = threading.Event()
    second = []

    def publish_again():
        started.set()
        second.append(publisher.publish(weights(2), step=2))
        second.append(first.done())  # as the second publish returns

    caller = threading.Thread(target=publish_again)
    caller.start()
    started.wait(30)
    assert not first.done() and not second  # still held: the second publish has not started
    gate.set()
    caller.join(60)
    assert second[1] is True and first.result().step == 1
    assert publisher.close().step == 2
    assert [entry.step for entry in versions.list_versions(tmp_path)] == [1, 2]


def test_tensors_are_converted_on_the_publishing_thread(tmp_path):
    lazy = {key: Lazy(value) for key, value in weights(3).items()}
    with ws.BackgroundPublisher(tmp_path) as publisher:
        publisher.publish(lazy, step=3)
    for value in lazy.values():
        assert len(value.converted_on) == 1 and value.converted_on[0] is not threading.current_thread()
    np.testing.assert_array_equal(ws.load(ws.latest(tmp_path))["dense/kernel"], weights(3)["dense/kernel"])


@pytest.mark.parametrize("fmt", ["npz", "hdf5"])
def test_each_value_is_let_go_once_written(tmp_path, gate, fmt):
    """A snapshot nobody else holds is freed tensor by tensor as it is written, not all at the
    end: in HDF5 too, whose writer asks every tensor's shape before writing any (values that
    cannot say it without being converted are not converted to plan the file)."""
    holders, buffers = [], []
    alive_at_conversion = []

    class Holder:
        """Holds its buffer as a TF tensor does; counts the holders (and the buffers: planning
        a file could keep those) converted before it that are alive. 2 MB each, more than a
        writer gathers before it writes."""

        dtype = np.dtype(np.float32)

        def __init__(self):
            self.array = np.ones((512, 1024), np.float32)
            holders.append(weakref.ref(self))
            buffers.append(weakref.ref(self.array))

        def __array__(self, dtype=None, copy=None):
            before = len(alive_at_conversion)
            alive_at_conversion.append(sum(ref() is not None for ref in holders[:before] + buffers[:before]))
            return self.array

    with ws.BackgroundPublisher(tmp_path, format=fmt) as publisher:
        publisher.publish({f"t{i}": Holder() for i in range(5)}, step=1)
        gate.set()  # write only once the caller has let go of its dict
    assert alive_at_conversion == [0] * 5
    assert ws.load(ws.latest(tmp_path))["t4"].sum() == 512 * 1024


def test_a_failed_publish_raises_on_the_next_publish_once(tmp_path):
    ws.publish(tmp_path, weights(10), step=10)  # another trainer got there first
    publisher = ws.BackgroundPublisher(tmp_path)
    publisher.publish(weights(5), step=5)  # returns: the failure happens on the thread
    with pytest.raises(ws.PublishError, match=r"step 5 is not after step 10") as raised:
        publisher.publish(weights(11), step=11)
    assert str(tmp_path) in str(raised.value)
    assert ws.latest(tmp_path).step == 10  # the publish that raised did not happen
    assert publisher.publish(weights(11), step=11).result().step == 11  # raised once; usable again
    assert publisher.close().step == 11


def test_a_bad_step_is_refused_at_the_call_and_costs_no_later_publish(tmp_path):
    """Checked on the thread, a bad step failed the future and then made the next, good
    publish raise it instead of publishing."""
    publisher = ws.BackgroundPublisher(tmp_path)
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            publisher.publish(weights(1), step=bad)
    assert publisher.publish(weights(4), step=np.int64(4)).result().step == 4  # optimizer.iterations.numpy()
    assert publisher.close().step == 4


@pytest.mark.parametrize("keep", [0, 1.5, True, "2"])
def test_keep_must_be_an_int_of_at_least_one(tmp_path, keep):
    with pytest.raises(ValueError, match="keep must be an int of at least 1"):
        ws.publish(tmp_path, weights(1), step=1, keep=keep)
    with pytest.raises(ValueError, match="keep must be an int of at least 1"):
        ws.BackgroundPublisher(tmp_path, keep=keep)
    assert ws.latest(tmp_path) is None


def test_a_failed_publish_raises_on_close_and_wait(tmp_path):
    ws.publish(tmp_path, weights(10), step=10)
    publisher = ws.BackgroundPublisher(tmp_path)
    publisher.publish(weights(5), step=5)
    with pytest.raises(ws.PublishError, match="steps must increase"):
        publisher.close()
    assert publisher.wait() is None  # raised once
    with pytest.raises(RuntimeError, match="closed") as caught:
        publisher.publish(weights(12), step=12)
    assert caught.value.path == str(tmp_path)
    other = ws.BackgroundPublisher(tmp_path)
    other.publish(weights(6), step=6)
    with pytest.raises(ws.PublishError):
        other.wait()


def test_an_error_seen_through_the_future_is_not_raised_again(tmp_path):
    ws.publish(tmp_path, weights(10), step=10)
    with ws.BackgroundPublisher(tmp_path) as publisher:
        with pytest.raises(ws.PublishError):
            publisher.publish(weights(5), step=5).result()
        assert publisher.publish(weights(11), step=11).result().step == 11


def test_a_folder_that_becomes_unusable_surfaces_when_the_block_ends(tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(ws.TargetError, match="run: is not a folder"), ws.BackgroundPublisher(folder) as publisher:
        publisher.publish(weights(1), step=1).result()
        shutil.rmtree(folder)
        folder.write_bytes(b"not a folder any more")
        publisher.publish(weights(2), step=2)


def test_the_blocks_own_error_wins_and_carries_the_publish_error(tmp_path):
    ws.publish(tmp_path, weights(10), step=10)
    with pytest.raises(KeyError, match="from the block") as raised, ws.BackgroundPublisher(tmp_path) as publisher:
        publisher.publish(weights(5), step=5)
        raise KeyError("from the block")
    assert any("step 5 is not after step 10" in note for note in getattr(raised.value, "__notes__", []))


def test_bad_options_fail_at_once(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        ws.BackgroundPublisher(tmp_path, keep=0)
    with pytest.raises(ValueError, match="zip"):
        ws.BackgroundPublisher(tmp_path, format="zip")
    with pytest.raises(TypeError, match="JSON"):
        ws.BackgroundPublisher(tmp_path, metadata={"when": object()})
