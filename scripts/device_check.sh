#!/usr/bin/env bash
# One-shot GPU check (issue 10): kernels, model families, service exactness, sync-free steps,
# async/speculation throughput with CUDA graphs on and off. Finishes in under 8 minutes on one
# H200. Usage: scripts/device_check.sh OUT_DIR [--dry-run] [--only SECTIONS]
# Needs torch, triton, grpcio, protobuf, prometheus-client, transformers, tokenizers; nothing is
# downloaded (random weights of real shapes, generated tokenizers). Writes OUT_DIR/device_check.json
# and OUT_DIR/device_check.md; exits non-zero when a check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: $0 OUT_DIR [--dry-run] [--only kernels,families,service,sync_free,throughput]" >&2
  exit 2
fi
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
# Without a pip install of the package, `python -m zerobubble` (the service check) needs the
# checkout on the path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 900 "$PY" scripts/device_check.py "$@"
