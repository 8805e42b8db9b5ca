"""Waiting, in tests, for what a test cannot be told about: another process, a thread's side effect."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(condition: Callable[[], T], *, what: str, timeout: float = 30.0, every: float = 0.01) -> T:
    """``condition()``'s first true result, polled every ``every`` seconds; the test fails after
    ``timeout`` seconds, saying ``what`` never happened. The timeout only bounds a broken run:
    a passing run waits as long as the condition takes, so no timing is asserted."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(every)
