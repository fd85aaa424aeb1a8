"""The light install: `pip install zerobubble` is the client and the client CLI commands only.

Runs in the main environment and in `make test-floor` (grpcio/protobuf at their declared floors,
no torch): the client modules and the stubs load there, and `generate`/`bench` import nothing heavy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = (
    "torch",
    "transformers",
    "numpy",
    "fastapi",
    "uvicorn",
    "matplotlib",
    "tokenizers",
    "jinja2",
    "prometheus_client",
    "zerobubble.scheduler_svc",
    "zerobubble.worker_svc",
    "zerobubble.kernels",
)


def imported_after(code: str) -> set[str]:
    """Modules (packages included) loaded by a fresh interpreter after running `code`."""
    script = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_client_commands_import_nothing_heavy(command: str) -> None:
    code = (
        "from zerobubble.entrypoints.cli import build_parser, dispatch\n"
        f"args = build_parser(env={{}}).parse_args([{command!r}])\n"
        "import zerobubble.client, zerobubble.bench"
    )
    assert not imported_after(code) & set(HEAVY)


def test_stubs_load_on_the_installed_runtime() -> None:
    from zerobubble.api import generate_pb2, generate_pb2_grpc  # noqa: F401

    request = generate_pb2.GenerateRequest(prompt="hi")
    request.sampling.n = 2
    assert generate_pb2.GenerateRequest.FromString(request.SerializeToString()) == request


def test_base_dependencies_are_client_only() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {
        dep.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower() for dep in project["dependencies"]
    }
    assert not names & {"torch", "transformers", "numpy", "fastapi", "uvicorn", "matplotlib", "tokenizers"}
    extras = project["optional-dependencies"]
    assert {"scheduler", "worker", "all"} <= set(extras)
