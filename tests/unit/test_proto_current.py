"""The committed stubs in zerobubble/api/ are exactly what `make proto` generates from proto/."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from zerobubble.tools.protogen import GRPCIO_TOOLS_VERSION, ROOT, generate


def _grpcio_tools_version() -> str | None:
    try:
        return version("grpcio-tools")
    except PackageNotFoundError:
        return None


# Other grpcio-tools releases emit other version stamps; `make test-floor` has the pinned one.
@pytest.mark.skipif(
    _grpcio_tools_version() != GRPCIO_TOOLS_VERSION,
    reason=f"needs grpcio-tools=={GRPCIO_TOOLS_VERSION} (make test-floor)",
)
def test_generated_stubs_are_current(tmp_path: Path) -> None:
    generated = generate(tmp_path)
    assert generated, "no .proto files found"
    for path in generated:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run `make proto`"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make proto`"


def test_both_services_are_defined() -> None:
    from zerobubble.api import generate_pb2, worker_pb2

    assert set(generate_pb2.DESCRIPTOR.services_by_name) == {"Generation"}
    assert set(worker_pb2.DESCRIPTOR.services_by_name) == {"Worker"}
    methods = generate_pb2.DESCRIPTOR.services_by_name["Generation"].methods_by_name
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    execute = worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name["Execute"]
    assert execute.server_streaming and execute.client_streaming
