"""Which asyncio event loop a process runs on: the services' and the clients' one choice.

Kept apart from :mod:`zerobubble.rpc` so that a client-only install (no health checking, no
reflection, maybe no uvloop) can use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T], event_loop: str) -> T:
    """Run ``main`` to the end on the event loop ``event_loop`` names: "uvloop", "asyncio", or
    "auto" (uvloop where it is installed). Clients use it too: a benchmark's client shares the
    machine with what it measures, and on uvloop it reads a stream's messages with less CPU
    (docs/benchmarks/host.md, "Smaller measurements the code relies on")."""
    if event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise
        else:
            return uvloop.run(main)
    return asyncio.run(main)
