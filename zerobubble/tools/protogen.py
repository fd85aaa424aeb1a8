"""Regenerate the Python stubs in `zerobubble/api/` from `proto/` (run `make proto`).

The `.proto` files are the single source of truth; the stubs are committed so that an install
needs no protoc, and `tests/unit/test_proto_current.py` fails when they are stale.

The stubs are generated with an old grpcio-tools on purpose: generated code requires a runtime
at least as new as the generator (grpcio >= its version, protobuf >= the protoc it bundles), so
this pin sets the grpcio/protobuf floors of every application that embeds our client. Newer
runtimes load the stubs too. `make proto` runs in the floor environment that has it.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
# Released 2025-09; its protoc emits protobuf 6.31.1 gencode. Floors in pyproject.toml follow it.
GRPCIO_TOOLS_VERSION = "1.75.1"


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto under proto/ into `out_dir`; return the generated files."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    stems = [out_dir / proto[: -len(".proto")] for proto in protos]
    return [Path(f"{stem}{suffix}") for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main() -> None:
    for path in generate(ROOT):
        print(path.relative_to(ROOT))


if __name__ == "__main__":
    main()
