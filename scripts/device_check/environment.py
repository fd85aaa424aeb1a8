"""``environment``: the packages the sections need, the versions used, the project's imports."""

from __future__ import annotations

from device_check.common import FAIL, PASS, Context

# Imported by the service but not among the packages a GPU machine is said to have: bring their
# wheels (`pip download --no-deps` these, well under 64 MiB together) and `pip install` them there.
EXTRA_MODULES = {
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "jinja2": "jinja2 markupsafe",
    "safetensors": "safetensors",
}


# What the other sections import from this project; a failure here (say, the committed gRPC
# stubs need a newer protobuf than the machine has) explains the failures that follow it.
PROJECT_MODULES = (
    "zerobubble.api.worker_pb2",
    "zerobubble.worker_svc.runner",
    "zerobubble.scheduler_svc.scheduler",
    "zerobubble.rpc",
)


def check_environment(ctx: Context) -> None:
    """The packages the other sections need, with the wheels to bring for any that is missing;
    the versions the run used; whether this project's modules import here."""
    import importlib
    import importlib.metadata
    import importlib.util

    for module, wheels in EXTRA_MODULES.items():
        found = importlib.util.find_spec(module) is not None
        ctx.add(
            "environment",
            module,
            PASS if found else FAIL,
            "" if found else f"missing: pip download --no-deps {wheels}, then pip install them here",
        )
    versions = {}
    for dist in ("torch", "triton", "grpcio", "protobuf", "transformers", "tokenizers", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "absent"
    ctx.add("environment", "versions", PASS, ", ".join(f"{k} {v}" for k, v in versions.items()), **versions)
    for module in PROJECT_MODULES:
        try:
            importlib.import_module(module)
            ctx.add("environment", f"import {module}", PASS)
        except Exception as exc:
            ctx.add("environment", f"import {module}", FAIL, f"{type(exc).__name__}: {exc}")
