"""Test-side names for the service launcher (see zerobubble/tools/launch.py)."""

from zerobubble.tools.launch import Service, start, start_scheduler, start_worker, wait_serving

__all__ = ["Service", "start", "start_scheduler", "start_worker", "wait_serving"]
