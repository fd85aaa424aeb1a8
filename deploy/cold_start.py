"""Cold start of the CPU image: ``podman run`` to the first streamed token over HTTP.

``python -m deploy.cold_start [--image IMAGE] [--runs N]`` starts ``zerobubble serve`` (scheduler
and one worker in one container, the cpu-demo overlay's device and dtype) on the host network,
sends one streamed completion as soon as the HTTP port is announced, and prints the seconds from
``podman run`` to its first token, and to the container's port announcement, for each run. The
container is removed after each run, so every run starts from the image as a new pod would.
The compiled CPU kernels serve 16-bit models only (float32 keeps torch's ops): with
``--dtype bfloat16``, ``--fresh-kernels`` points torch's extension cache at an empty folder, so
the worker compiles them at start, as on a node whose CPU differs from the build machine's.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import shlex
import statistics
import subprocess
import time
import urllib.error
import urllib.request

PODMAN = shlex.split("podman --runtime runc --cgroup-manager=cgroupfs")
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]
ENV = {"ZEROBUBBLE_DEVICE": "cpu", "ZEROBUBBLE_NUM_THREADS": "2"}
PROMPT = "The capital of France is"


def http_port(name: str, timeout: float) -> int:
    """The HTTP port ``name``'s service announced on stdout (``ZEROBUBBLE_HTTP_PORT=n``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = subprocess.run([*PODMAN, "logs", name], capture_output=True, text=True).stdout
        found = re.search(r"^ZEROBUBBLE_HTTP_PORT=(\d+)$", logs, re.M)
        if found:
            return int(found.group(1))
        time.sleep(0.05)
    raise TimeoutError(f"{name} announced no HTTP port in {timeout} s")


def first_token(port: int, timeout: float) -> None:
    """Returns once a streamed completion has delivered a token; retries while nothing serves."""
    body = json.dumps({"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 4, "stream": True}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                for line in reply:
                    if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                        return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no token in {timeout} s")


def one_run(image: str, timeout: float, dtype: str, fresh_kernels: bool) -> tuple[float, float]:
    """(seconds to the port announcement, seconds to the first token) of one fresh container."""
    name = f"zb-cold-start-{secrets.token_hex(3)}"
    extra = {"ZEROBUBBLE_DTYPE": dtype}
    if fresh_kernels:
        extra["TORCH_EXTENSIONS_DIR"] = "/tmp/torch_extensions"
    env = [arg for key, value in (ENV | extra).items() for arg in ("--env", f"{key}={value}")]
    flags = ["--detach", "--name", name, "--network", "host", *ULIMITS, *env]
    args = ["serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--metrics-port", "-1"]
    start = time.monotonic()
    try:
        subprocess.run([*PODMAN, "run", *flags, image, *args], check=True, capture_output=True)
        port = http_port(name, timeout)
        announced = time.monotonic() - start
        first_token(port, timeout)
        return announced, time.monotonic() - start
    finally:
        subprocess.run([*PODMAN, "rm", "--force", "--time", "0", name], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="localhost/zerobubble:0.1.0")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--dtype", default="float32", help="the worker's dtype (float32: the cpu-demo overlay's)")
    parser.add_argument("--fresh-kernels", action="store_true", help="compile the CPU kernels at start")
    opts = parser.parse_args()
    firsts = []
    for i in range(opts.runs):
        announced, first = one_run(opts.image, opts.timeout, opts.dtype, opts.fresh_kernels)
        firsts.append(first)
        print(f"run {i + 1}: HTTP port announced {announced:.1f} s, first token {first:.1f} s after podman run")
    print(f"first token: median {statistics.median(firsts):.1f} s over {opts.runs} runs")


if __name__ == "__main__":
    main()
