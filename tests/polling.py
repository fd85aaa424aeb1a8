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
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)


async def wait_until_async(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.01) -> T:
    """`wait_until` inside an event loop: sleeps without blocking it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(poll)
