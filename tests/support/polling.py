"""Waiting in tests for something another process does (a metric settling, a front restarting).

One helper instead of a deadline loop per test, so that every wait has a bound and a timeout
says what was awaited rather than failing on the assertion after the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.1) -> T:
    """Poll ``predicate()`` until it returns something truthy and return that value; fail the
    test with ``what`` when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not (value := _check(predicate, deadline, timeout, what)):
        time.sleep(poll)
    return value


async def wait_until_async(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.01) -> T:
    """`wait_until` inside an event loop: sleeps without blocking it."""
    deadline = time.monotonic() + timeout
    while not (value := _check(predicate, deadline, timeout, what)):
        await asyncio.sleep(poll)
    return value


def _check(predicate: Callable[[], T], deadline: float, timeout: float, what: str) -> T:
    """One poll: the predicate's value, or the test's failure once the deadline has passed."""
    value = predicate()
    if not value and time.monotonic() > deadline:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
    return value
