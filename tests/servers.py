"""Test-side names for the service launcher (see zerobubble/launch.py)."""

from zerobubble.launch import Service, start, start_scheduler, start_worker, wait_serving

__all__ = ["Service", "start", "start_scheduler", "start_worker", "wait_serving"]
