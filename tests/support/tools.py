"""External programs some tests need (kubectl, promtool, prometheus, podman), found or skipped clearly.

Outside CI a missing program skips the test with a message naming what to install. Under CI
(``CI`` set, as ``.ci/run`` does) it fails instead: a test that is skipped in CI is a test that
does not exist, and ``make test`` installs what it can.
"""

from __future__ import annotations

import os
import shutil

import pytest

# program -> how to get it
SOURCES: dict[str, str] = {
    "kubectl": "install kubectl (https://kubernetes.io/docs/tasks/tools/)",
    "promtool": "install the Debian/Ubuntu package 'prometheus' (apt-get install prometheus; "
    "`make test` does it as root)",
    "prometheus": "install the Debian/Ubuntu package 'prometheus' (apt-get install prometheus; "
    "`make test` does it as root)",
    "podman": "install the Debian/Ubuntu packages 'podman runc' (`make images` does it as root)",
    "runc": "install the Debian/Ubuntu package 'runc' (`make images` does it as root)",
}


def require(program: str) -> str:
    """The path of ``program``; skips the calling test when it is missing (fails under CI)."""
    path = shutil.which(program)
    if path is not None:
        return path
    message = f"{program} not found on PATH: {SOURCES.get(program, 'install it')}"
    if os.environ.get("CI"):
        pytest.fail(f"{message}. CI must provide it: a skipped test counts as missing.")
    pytest.skip(message)
