#!/usr/bin/env bash
# One-shot GPU check: kernels, model families, service exactness, sync-free steps,
# async/speculation throughput with CUDA graphs on and off. Keeps to 8 minutes on one H200
# (`--time-budget`, 420 s of sections by default; this wrapper stops it at 480 s, and SIGTERM
# still writes the report). Usage: scripts/device_check.sh OUT_DIR [--dry-run] [--only SECTIONS]
# Needs torch, triton, grpcio, protobuf, prometheus-client, transformers, tokenizers; nothing is
# downloaded (random weights of real shapes, generated tokenizers). Writes OUT_DIR/device_check.json,
# OUT_DIR/device_check.md (rewritten after every section) and OUT_DIR/device_check.log; exits
# non-zero when a check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "usage: $0 OUT_DIR [--dry-run] [--only kernels,families,service,sync_free,throughput,served] [--time-budget S]" >&2
  exit 2
fi
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
# Without a pip install of the package, `python -m zerobubble` (the service check) needs the
# checkout on the path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$1"
# Wheels carried to a machine that cannot download (docs/benchmarks/h200.md): installed into a
# folder of this run's own, ahead of the machine's packages on the path.
WHEELS=${DEVICE_WHEELS:-.device-wheels}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  site=$(mktemp -d)
  # Wheels for another Python (a developer's own checkout) are refused: run on without them,
  # the environment section then says what is missing.
  if "$PY" -m pip install -q --no-index --no-deps --target "$site" "$WHEELS"/*.whl; then
    export PYTHONPATH="$site:$PYTHONPATH"
  else
    echo "device_check: the wheels in $WHEELS did not install here; running without them" >&2
  fi
fi
# A longer --time-budget needs a longer limit: DEVICE_CHECK_TIMEOUT_S (the budget plus a minute).
timeout -s TERM -k 15 "${DEVICE_CHECK_TIMEOUT_S:-480}" "$PY" scripts/device_check "$@" 2>&1 | tee "$1/device_check.log"
