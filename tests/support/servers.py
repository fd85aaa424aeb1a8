"""Test-side names for the service launcher (see zerobubble/tools/launch.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from zerobubble.tools.launch import Service, start, start_scheduler, start_worker, wait_serving

__all__ = ["Service", "serving", "start", "start_scheduler", "start_worker", "wait_serving"]


@contextlib.contextmanager
def serving(worker_options: dict[str, Any], **scheduler_options: Any) -> Iterator[Service]:
    """A worker and a scheduler over it, the scheduler serving; both stopped on exit."""
    worker = start_worker(**worker_options)
    try:
        scheduler = start_scheduler([worker], **scheduler_options)
        try:
            wait_serving(scheduler.target)
            yield scheduler
        finally:
            scheduler.stop()
    finally:
        worker.stop()
