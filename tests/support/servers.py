"""Test-side names for the service launcher (see zerobubble/tools/launch.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from zerobubble.tools import launch
from zerobubble.tools.launch import Service, start, start_scheduler, wait_serving

__all__ = ["Service", "serving", "start", "start_scheduler", "start_worker", "wait_serving"]


def start_worker(**options: Any) -> Service:
    """`launch.start_worker`, without speculation unless the test names a --spec-method: the
    worker's default (`auto`, n-gram drafts) changes step counts and draft figures that tests
    of other things count on; tests/services/test_async_spec_e2e.py runs `auto` itself."""
    options.setdefault("spec_method", "none")
    return launch.start_worker(**options)


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
