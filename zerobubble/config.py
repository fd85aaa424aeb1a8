"""Every setting of the two services, in one torch-free module.

Each service's configuration is a dataclass whose fields carry their help text, choices and
secret-ness as field metadata (:func:`setting`). The CLI builds its flags and ``ZEROBUBBLE_*``
environment fallbacks from these fields, the deploy check reads them to verify that every
setting is reachable from the manifests, and the inner configs (``SchedulerConfig``,
``RunnerConfig``) take their defaults from here. A default therefore exists exactly once.

Flag combinations are checked by each config's ``validate()``, with an error that names the
flags, so a bad command line fails before a model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from zerobubble.api import worker_pb2

ENV_PREFIX = "ZEROBUBBLE_"
# --spec-draft-length (zerobubble.scheduler_svc.draft_length.CHOICES; config stays import-free).
DRAFT_LENGTHS = ("adaptive", "fixed")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
# --cpu-linear: zerobubble.kernels.linear_choice.CHOICES (that module imports torch; a test keeps them equal).
CPU_LINEAR_CHOICES = ("auto", "default", "blocks", "onednn", "dense", "int8-rows", "int8-torch", "int8-widened", "int4")

# gRPC's own runtime switches that our processes run with unless `GRPC_EXPERIMENTS` is set.
# Its EventEngine endpoints hand every read and write between their own threads and the
# completion queue's poller; the polling engine they replace does the I/O on the polling thread.
# Each hand-off wakes a thread, and a message's cost is mostly wake-ups: without them a step
# costs less where each message wakes a thread (docs/benchmarks/host.md, "gRPC without its
# EventEngine endpoints"). Known to grpcio 1.75 through 1.85 (an unknown name is logged as an
# error, not refused).
GRPC_EXPERIMENTS_DEFAULT = (
    "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints,-event_engine_callback_cq"
)


def apply_grpc_defaults(environ: MutableMapping[str, str]) -> None:
    """Set `GRPC_EXPERIMENTS_DEFAULT` unless the environment says otherwise (an empty
    `GRPC_EXPERIMENTS` keeps gRPC's own defaults). gRPC reads it when it starts, so this must
    run before the process first imports grpc; the services' child processes inherit it."""
    environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS_DEFAULT)


def keepalive_options(time_ms: int, timeout_ms: int) -> list[tuple[str, int]]:
    """gRPC arguments that ping a connection after `time_ms` without data and close it when a
    ping stays unanswered for `timeout_ms`.

    gRPC closes the connection after its ping timeout (`grpc.http2.ping_timeout_ms`, one minute
    by default wherever keepalive is on), whatever `grpc.keepalive_timeout_ms` says: with only
    the latter at 5 s, a scheduler noticed a SIGSTOPped worker 60 s after the stop ("Stream
    removed (ping timeout)"), with both 5 s after it (tests/services/test_multi_worker.py).
    """
    return [
        ("grpc.keepalive_time_ms", time_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    ]


def check_event_loop(event_loop: str) -> None:
    """`--event-loop uvloop` needs the uvloop package (auto falls back to asyncio without it)."""
    _require(
        event_loop != "uvloop" or importlib.util.find_spec("uvloop") is not None,
        "--event-loop uvloop: the uvloop package is not installed (pip install uvloop; or --event-loop asyncio)",
    )


# `--spec-method`; "auto" resolves to one of the others when the config is made (`resolve_spec_method`).
SPEC_METHODS = ("auto", "none", "ngram", "suffix", "draft", "eagle")
# What `--spec-method auto` is without a draft model. n-gram over suffix decoding: suffix gained
# 1.05x over it at concurrency 1 on the agentic workload, for a scheduler-side index whose
# upkeep is on the planning loop's critical path at high concurrency, and it needs no scheduler
# support (a simulated device, an older scheduler).
AUTO_SPEC_METHOD = "ngram"

_Config = TypeVar("_Config")


class ConfigError(ValueError):
    """A combination of settings that cannot work; the message names the flags."""


@dataclass(frozen=True, slots=True)
class SettingInfo:
    """What the CLI and the deploy check need to know about one setting."""

    help: str
    choices: tuple[Any, ...] | None = None
    # Credentials and key material (file paths included): manifests take them from a Secret,
    # never a ConfigMap, which any reader of the namespace sees.
    secret: bool = False


def setting(default: Any, help: str, *, choices: Sequence[Any] | None = None, secret: bool = False) -> Any:
    """A dataclass field with its documentation attached (see the module docstring)."""
    info = SettingInfo(help, tuple(choices) if choices is not None else None, secret)
    return dataclasses.field(default=default, metadata={"setting": info})


def setting_info(f: dataclasses.Field) -> SettingInfo:
    """The :class:`SettingInfo` of a field declared with :func:`setting`."""
    return f.metadata["setting"]


def flag_name(field_name: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field_name.replace("_", "-")


def env_name(flag_or_field: str) -> str:
    """Environment variable backing a flag (``--max-num-seqs`` -> ``ZEROBUBBLE_MAX_NUM_SEQS``)."""
    return ENV_PREFIX + flag_or_field.lstrip("-").replace("-", "_").upper()


_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_bool(text: str) -> bool:
    """Read a boolean the way people write it in environment files."""
    word = text.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"expected one of 1/true/yes/0/false/no, got {text!r}")


def parse_setting(f: dataclasses.Field, raw: str) -> Any:
    """A setting's value from its text form (an environment variable); ``ValueError`` if bad."""
    kind: Any = type(f.default)
    value = parse_bool(raw) if kind is bool else kind(raw)
    choices = setting_info(f).choices
    if choices is not None and isinstance(value, str):
        value = value.lower()  # choices are lower-case words; `DEBUG` means `debug`
    if choices is not None and value not in choices:
        raise ValueError(f"choose from {', '.join(map(str, choices))}")
    return value


def from_env(cls: type[_Config], env: Mapping[str, str]) -> _Config:
    """A config from ``ZEROBUBBLE_*`` variables alone, as a container would start; validated.

    :class:`ConfigError` names the variable whose value cannot be read.
    """
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = env.get(env_name(f.name), "")
        if raw:
            try:
                values[f.name] = parse_setting(f, raw)
            except ValueError as exc:
                raise ConfigError(f"{env_name(f.name)}={raw!r}: {exc}") from exc
    config = cls(**values)
    config.validate()  # type: ignore[attr-defined]
    return config


def default_of(cls: type, name: str) -> Any:
    """The declared default of setting ``name`` of config class ``cls``."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def from_namespace(cls: type[_Config], args: argparse.Namespace) -> _Config:
    """A config filled from parsed flags of the same names (missing ones keep their default)."""
    return cls(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if hasattr(args, f.name)
        }
    )


@dataclass(slots=True)
class ServiceConfig:
    """Where a service listens and how it secures its port; shared by worker and scheduler."""

    log_level: str = setting("info", "logging verbosity", choices=LOG_LEVELS)
    host: str = setting("0.0.0.0", "address to bind the gRPC server to")
    port: int = setting(0, "gRPC port (0 = pick a free port)")
    metrics_port: int = setting(-1, "Prometheus /metrics port (-1 = off, 0 = pick a free port)")
    tls_cert: str = setting("", "PEM server certificate; TLS is on when set", secret=True)
    tls_key: str = setting("", "PEM private key of --tls-cert", secret=True)
    # The worker sizes its state slots and the scheduler its batches from the same number, so
    # `serve` gives both one value.
    max_num_seqs: int = setting(64, "most requests running at once")
    event_loop: str = setting(
        "auto",
        "asyncio event loop of the service: uvloop (libuv: less host CPU per gRPC message and stream), the "
        "standard library's asyncio, or auto = uvloop where it is installed",
        choices=EVENT_LOOPS,
    )
    cpu_affinity: str = setting(
        "",
        "cores (e.g. 0 or 2-7,9) the service's process runs on, every thread of it: a core of its own "
        "for the scheduler beside a worker on one machine keeps the two from preempting each other "
        "(serve: the scheduler's process; empty = any core)",
    )

    def validate(self) -> None:
        """:class:`ConfigError` naming the flags when a setting or a combination cannot work."""
        _require(bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key go together")
        if self.cpu_affinity:
            available_cores(self.cpu_affinity, "--cpu-affinity")
        check_event_loop(self.event_loop)
        _require(self.max_num_seqs >= 1, "--max-num-seqs must be >= 1")
        _require(-1 <= self.metrics_port <= 65535, "--metrics-port must be -1 (off) or a port")
        _require(0 <= self.port <= 65535, "--port must be a port number (0 = pick one)")


@dataclass(slots=True)
class WorkerConfig(ServiceConfig):
    """Everything `zerobubble worker` is configured with."""

    port: int = setting(50061, "gRPC port (0 = pick a free port)")
    metrics_port: int = setting(9091, "Prometheus /metrics port (-1 = off, 0 = pick a free port)")
    tls_client_ca: str = setting(
        "", "PEM CA for client certificates; when set, clients must present one (mutual TLS)", secret=True
    )
    model: str = setting("smollm2-135m", "'smollm2-135m' (embedded), a Hugging Face directory or a .gguf file")
    dtype: str = setting(
        "auto",
        "activations', weights' and KV cache's dtype (auto = bfloat16 on a CPU with AVX-512-BF16 or "
        "AMX-BF16 and on CUDA from compute capability 8.0; float16 on older GPUs; float32 on other CPUs)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    quantization: str = setting(
        "none",
        "weight quantization (CPU only, activations in --dtype): int8 = weight-only int8 with a scale "
        "per output channel (half bfloat16's weight memory; the fastest with the compiled CPU kernels "
        "on AVX-512 BF16); int4 = weight-only 4-bit in groups of 32 with a scale and minimum each, "
        "llama.cpp's Q4_1 layout (a quarter of the memory, slower than int8 for many concurrent requests)",
        choices=("none", "int8", "int4"),
    )
    device: str = setting("auto", "where the model runs (auto = cuda when available)", choices=("auto", "cpu", "cuda"))
    block_size: int = setting(16, "tokens per KV cache block")
    kv_cache_memory_gb: float = setting(2.0, "KV cache budget on CPU, in GiB")
    gpu_memory_utilization: float = setting(
        0.9, "fraction of GPU memory the worker may fill (weights, KV cache and a full step's logits)"
    )
    max_model_len: int = setting(0, "longest sequence in tokens (0 = from the model config, capped at 8192)")
    spec_method: str = setting(
        "auto",
        "speculative decoding proposer: auto (ngram, its draft length adaptive unless the scheduler's "
        "--spec-draft-length is fixed; not with --draft-model), none, ngram (prompt lookup), suffix "
        "(suffix decoding: the scheduler finds each request's likeliest continuation in its own text "
        "and in recent outputs of all requests, up to --num-prediction-tokens drafts a step, prompt "
        "lookup meanwhile), draft (a smaller model) or eagle (an EAGLE-1, EAGLE-3 or "
        "speculators-format head over the target's hidden states)",
        choices=SPEC_METHODS,
    )
    num_spec_tokens: int = setting(3, "draft tokens per decode step")
    num_prediction_tokens: int = setting(
        16,
        "most draft tokens per decode step taken from a request's predicted output (OpenAI's "
        "`prediction`), with any --spec-method, and from a suffix continuation (--spec-method suffix, "
        "at least --num-spec-tokens); 0 ignores predictions",
    )
    ngram_min: int = setting(2, "shortest n-gram the proposer matches")
    ngram_max: int = setting(4, "longest n-gram the proposer matches")
    draft_model: str = setting(
        "",
        "--spec-method draft: a smaller model with --model's tokenizer; --spec-method eagle: an EAGLE "
        "head directory or a built-in head name (smollm2-135m-eagle)",
    )
    draft_quantization: str = setting(
        "none",
        "weight quantization of the draft model's or EAGLE head's linear weights (CPU only, as "
        "--quantization): drafts only, verification keeps the output exact; int8 halves the bytes "
        "each draft step reads",
        choices=("none", "int8", "int4"),
    )
    draft_acceptance: str = setting(
        "keyed",
        "how draft-model and EAGLE proposals are verified: keyed (accepted iff equal to the target's own "
        "keyed sample: seeded output identical with speculation on or off, sync or async) or "
        "rejection (min(1, p/q) rejection sampling: more drafts accepted when the draft model "
        "differs from the target, but seeded output then depends on the speculation)",
        choices=("keyed", "rejection"),
    )
    worker_id: str = setting("", "name in metrics and logs (empty = hostname:port)")
    num_threads: int = setting(0, "torch CPU threads (0 = torch default)")
    cpu_cores: str = setting(
        "",
        "CPU device: cores (e.g. 1 or 2-7,9) for the model's step thread and its torch threads; "
        "the worker's gRPC and copy threads run on the other cores, so host work never preempts "
        "a step (empty = no binding; torch threads default to the number of cores given)",
    )
    prepack_weights: bool = setting(
        True,
        "CPU: lay linear weights out once for the product that runs them (oneDNN's blocked "
        "layout; bfloat16 with --cpu-kernels on AVX-512 BF16: the compiled product's blocks); "
        "float32 weights then take twice the memory",
    )
    cpu_kernels: bool = setting(
        True,
        "CPU, bfloat16/float16: run the norms, rotation, SiLU, paged attention and the bfloat16 "
        "and int8 products as compiled C++ kernels (built once per machine with the host's "
        "compiler; torch ops where that fails)",
    )
    cpu_linear: str = setting(
        "auto",
        "CPU: the product that runs each linear weight: auto = the fastest for each weight shape "
        "and row count, timed on this machine at the first start and cached beside the compiled "
        "kernels (logged at info); default = the plan tuned on an AMD EPYC without AVX2-only or AMX "
        "paths, no timing; or one product wherever it can run a weight (benchmarks, tests)",
        choices=CPU_LINEAR_CHOICES,
    )
    auth_token: str = setting(
        "",
        "token the scheduler must send (its --worker-auth-token) to use Execute and "
        "Describe; health stays open (empty = no auth)",
        secret=True,
    )
    drain_timeout: float = setting(
        30.0,
        "seconds SIGTERM lets the scheduler finish this worker's requests before the "
        "stream closes (the manifests' grace period is 30 s)",
    )
    simulate_device_ms: float = setting(
        -1.0,
        "no model: every step takes this many ms on a simulated device and tokens come from a "
        "deterministic function of the sequence (load-test a scheduler or measure host cost "
        "without an accelerator; -1 = off)",
    )
    simulate_acceptance_rate: float = setting(
        0.6,
        "with --simulate-device-ms: probability that a token repeats the text 32 tokens "
        "earlier, i.e. that an n-gram draft is accepted when the one before it was",
    )
    # On since the first GPU run (docs/benchmarks/h200.md): exact against Hugging Face, no host sync,
    # 2.4-3.3x the eager decode rate of a 1.7B model, whose eager steps are bound by launches.
    cuda_graphs: bool = setting(
        True,
        "CUDA: capture decode-only steps as CUDA graphs at start-up (one per padded batch "
        "size x draft width) and replay them; prefill and mixed steps run eagerly; no effect "
        "on other devices",
    )

    tensor_parallel_size: int = setting(
        1,
        "devices (ranks) one worker's model is split over, Megatron-style (attention heads and MLP "
        "rows per rank, two all-reduces per layer): rank 0 serves gRPC and starts the others on "
        "this machine (one GPU each, cuda:LOCAL_RANK; on a CPU one torch thread each unless "
        "--num-threads); must divide the model's attention heads",
    )
    enable_expert_parallel: bool = setting(
        False,
        "with --tensor-parallel-size N: each rank holds N-th of a mixture of experts' experts whole and "
        "computes the tokens routed to them (N must divide the experts); off: every expert's rows split "
        "over the ranks like the dense MLP's. Either way every rank routes every token with the whole "
        "router, the shared expert is split by rows, and a sparse layer ends in one all-reduce",
    )
    nnodes: int = setting(
        1, "machines the --tensor-parallel-size ranks span (each starts --tensor-parallel-size / --nnodes of them)"
    )
    node_rank: int = setting(
        0, "this machine's place among --nnodes (0: the leader, which serves gRPC; others only join its group)"
    )
    master_addr: str = setting(
        "127.0.0.1",
        "with --nnodes > 1: the address of node 0, whose rendezvous port the other nodes join (the "
        "collective and rendezvous ports carry no authentication: admit only the group's machines)",
    )
    master_port: int = setting(
        0,
        "with --nnodes > 1: node 0's rendezvous port; with --nnodes 1 the ranks meet through a "
        "private file instead and collectives stay on loopback (0 = that case)",
    )

    def __post_init__(self) -> None:
        self.spec_method = resolve_spec_method(self.spec_method, self.draft_model)

    @property
    def simulated(self) -> bool:
        """Whether this worker runs on a simulated device instead of a model."""
        return self.simulate_device_ms >= 0

    @property
    def speculative(self) -> bool:
        """Whether this worker proposes drafts (the one place that decides it)."""
        return self.spec_method != "none" and self.num_spec_tokens > 0

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens a decode row carries: `--num-spec-tokens`, 0 without speculation."""
        return self.num_spec_tokens if self.speculative else 0

    def validate(self) -> None:
        ServiceConfig.validate(self)
        _require(self.block_size >= 1, "--block-size must be >= 1")
        _require(self.kv_cache_memory_gb > 0, "--kv-cache-memory-gb must be > 0")
        _require(0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]")
        _require(self.max_model_len >= 0, "--max-model-len must be >= 0 (0 = from the model)")
        _require(self.num_spec_tokens >= 0, "--num-spec-tokens must be >= 0")
        _require(0 <= self.num_prediction_tokens <= 64, "--num-prediction-tokens must be in [0, 64]")
        _require(self.num_threads >= 0, "--num-threads must be >= 0")
        if self.cpu_cores:
            cores_within(self.cpu_cores, "--cpu-cores", self.cpu_affinity)
        _require(self.drain_timeout >= 0, "--drain-timeout must be >= 0")
        self.validate_tensor_parallel()
        for flag, value in (("--quantization", self.quantization), ("--draft-quantization", self.draft_quantization)):
            _require(
                value == "none" or self.device != "cuda", f"{flag} {value} runs on the CPU only (--device cpu or auto)"
            )
        if self.spec_method == "ngram":
            _require(
                1 <= self.ngram_min <= self.ngram_max,
                f"--ngram-min {self.ngram_min} and --ngram-max {self.ngram_max}: need 1 <= --ngram-min <= --ngram-max",
            )
        _require(
            self.simulate_device_ms >= 0 or self.simulate_device_ms == -1,
            "--simulate-device-ms must be >= 0 (or -1: off)",
        )
        if self.simulated:
            _require(
                self.spec_method in ("none", "ngram"), "--simulate-device-ms works with --spec-method none or ngram"
            )
            _require(0 <= self.simulate_acceptance_rate <= 1, "--simulate-acceptance-rate must be in [0, 1]")
            _require(
                self.num_spec_tokens <= 30 or not self.speculative,
                "--simulate-device-ms supports at most 30 --num-spec-tokens",
            )
        if self.spec_method == "draft":
            _require(
                bool(self.draft_model),
                "--spec-method draft needs --draft-model (a smaller model with the same tokenizer as --model)",
            )
        elif self.spec_method == "eagle":
            _require(bool(self.draft_model), "--spec-method eagle needs --draft-model (an EAGLE head)")
        elif self.draft_model:
            raise ConfigError(
                f"--draft-model is set but --spec-method is {self.spec_method!r}; use --spec-method draft or eagle"
            )

    def validate_tensor_parallel(self) -> None:
        size, nnodes = self.tensor_parallel_size, self.nnodes
        _require(size >= 1, "--tensor-parallel-size must be >= 1")
        _require(nnodes >= 1, "--nnodes must be >= 1")
        _require(
            size % nnodes == 0,
            f"--tensor-parallel-size {size} must be a multiple of --nnodes {nnodes} (the same ranks on every node)",
        )
        _require(0 <= self.node_rank < nnodes, f"--node-rank {self.node_rank} must be in [0, --nnodes {nnodes})")
        _require(
            nnodes == 1 or 0 < self.master_port <= 65535,
            "--nnodes > 1 needs --master-port (node 0's rendezvous port)",
        )
        _require(size == 1 or not self.simulated, "--simulate-device-ms runs without a model: --tensor-parallel-size 1")
        _require(
            size > 1 or not self.enable_expert_parallel,
            "--enable-expert-parallel places experts over tensor-parallel ranks: it needs --tensor-parallel-size > 1 "
            f"(got {size})",
        )


def resolve_spec_method(spec_method: str, draft_model: str) -> str:
    """The concrete `--spec-method` for ``spec_method`` (the one place "auto" is resolved: a
    `WorkerConfig` holds the result, and the scheduler learns it from `WorkerInfo`).

    Raises:
        ConfigError: "auto" with a --draft-model, which may be a draft model or an EAGLE head.
    """
    if spec_method != "auto":
        return spec_method
    _require(not draft_model, "--spec-method auto with --draft-model: name its kind, --spec-method draft or eagle")
    return AUTO_SPEC_METHOD


@dataclass(slots=True)
class SchedulerServiceConfig(ServiceConfig):
    """Everything `zerobubble scheduler` is configured with."""

    port: int = setting(50051, "gRPC port (0 = pick a free port)")
    metrics_port: int = setting(9090, "Prometheus /metrics port (-1 = off, 0 = pick a free port)")
    workers: str = setting("", "workers to drive: 'host:port,host:port' or 'dns:///name:port'")
    max_inflight_steps: int = setting(2, "plans sent ahead of their results per worker (1 = synchronous)")
    max_num_batched_tokens: int = setting(512, "token budget of one step (prefill chunks + decode slots)")
    max_waiting: int = setting(1024, "queued requests beyond which new ones are refused (RESOURCE_EXHAUSTED)")
    stream_interval: int = setting(
        1,
        "tokens a stream gathers before it sends them (1 = each step's tokens as they come); the first "
        "token and the final message go at once. Larger values cut the host's work per step at high concurrency",
    )
    enable_prefix_caching: bool = setting(True, "share KV blocks of identical prompt prefixes")
    auth_token: str = setting("", "bearer token clients must send, on gRPC and HTTP (empty = no auth)", secret=True)
    http_port: int = setting(8000, "OpenAI-compatible HTTP port on --host (-1 = off, 0 = pick a free port)")
    worker_tls_ca: str = setting(
        "", "PEM CA that signed the workers' certificates; TLS to workers is on when set", secret=True
    )
    worker_tls_cert: str = setting("", "PEM client certificate for mutual TLS to workers", secret=True)
    worker_tls_key: str = setting("", "PEM private key of --worker-tls-cert", secret=True)
    worker_auth_token: str = setting(
        "",
        "token sent to the workers' --auth-token (a different secret from the clients' --auth-token; empty = none)",
        secret=True,
    )
    fronts: int = setting(
        0,
        "client-facing front processes (`zerobubble front`) that own the gRPC client calls on --host:--port "
        "and relay them over one stream each, so the planning loop sends one message per loop turn instead "
        "of one per client reply; they serve --http-port too, and the scheduler listens for them on "
        "loopback (0 = it serves its clients itself)",
    )
    loop_cores: str = setting(
        "",
        "cores (e.g. 0) for the scheduler's event-loop thread alone, its critical path at hundreds of "
        "streams; its other threads (gRPC's, the metrics server's) run on the rest of --cpu-affinity. "
        "'first': the first core the process may run on, e.g. of a container's cpuset (empty = no binding)",
    )
    lookahead_margin_ms: float = setting(
        20.0,
        "with long steps, a plan ahead of the running one goes out this many ms (at least a quarter "
        "of a step) before the worker is expected to need it instead of at once, so requests that "
        "arrive meanwhile still join it (-1 = always at once)",
    )
    step_deadline: float = setting(
        0.0,
        "seconds a worker may take to answer a step before it is declared lost and its "
        "requests move (0 = max(10 s, 20 x p99 of its recent steps))",
    )
    drain_timeout: float = setting(
        60.0,
        "seconds SIGTERM lets running requests finish before cancelling the rest (the manifests' grace period is 60 s)",
    )
    spec_disable_batch_size: int = setting(
        0,
        "plan no draft tokens while this many requests or more are running (vLLM's "
        "speculative_disable_by_batch_size): on a compute-bound device verifying drafts costs more "
        "than it saves in large batches; an explicit cap, which --spec-draft-length adaptive makes "
        "unneeded (0 = never disable)",
    )
    spec_draft_length: str = setting(
        "adaptive",
        "draft slots of each decode row when the worker speculates: adaptive (from the request's recent "
        "acceptance by draft position and the step's fitted cost per token, 0 where drafting does not pay; "
        "at most --num-spec-tokens, or suffix decoding's budget) or fixed (always --num-spec-tokens)",
        choices=DRAFT_LENGTHS,
    )
    max_prefill_tokens_with_decodes: int = setting(
        0,
        "prompt tokens a step may carry while requests are decoding, so that their next tokens "
        "never wait behind a long prefill chunk (a CPU computes a 512-token chunk in a third of a "
        "second); steps without decodes take the whole --max-num-batched-tokens (0 = no limit)",
    )

    def worker_addresses(self) -> list[str]:
        """``--workers`` split into its addresses."""
        return [a.strip() for a in self.workers.split(",") if a.strip()]

    def loop_core_set(self) -> frozenset[int]:
        """The cores `--loop-cores` names ('first': the lowest core the process may run on);
        :class:`ConfigError` unless they leave a core for the other threads."""
        spec = str(min(allowed_cores(self.cpu_affinity))) if self.loop_cores == "first" else self.loop_cores
        cores, rest = cores_within(spec, "--loop-cores", self.cpu_affinity)
        _require(bool(rest), f"--loop-cores {self.loop_cores}: leaves no core for the scheduler's other threads")
        return cores

    def validate(self, *, needs_workers: bool = True) -> None:
        """:class:`ConfigError` naming the flags; ``needs_workers`` False where the workers are
        given otherwise (`serve` starts its own)."""
        ServiceConfig.validate(self)
        _require(
            not needs_workers or bool(self.worker_addresses()),
            "--workers is required (host:port,... or dns:///name:port)",
        )
        _require(self.max_inflight_steps >= 1, "--max-inflight-steps must be >= 1 (1 = synchronous)")
        _require(self.max_num_batched_tokens >= 1, "--max-num-batched-tokens must be >= 1")
        _require(self.max_waiting >= 1, "--max-waiting must be >= 1")
        _require(self.stream_interval >= 1, "--stream-interval must be >= 1 (1 = send every step's tokens)")
        _require(self.step_deadline >= 0, "--step-deadline must be >= 0 (0 = derived)")
        _require(
            self.lookahead_margin_ms >= 0 or self.lookahead_margin_ms == -1,
            "--lookahead-margin-ms must be >= 0 (or -1: plans ahead go out at once)",
        )
        _require(self.drain_timeout >= 0, "--drain-timeout must be >= 0")
        _require(self.spec_disable_batch_size >= 0, "--spec-disable-batch-size must be >= 0 (0 = never disable)")
        _require(
            self.max_prefill_tokens_with_decodes >= 0, "--max-prefill-tokens-with-decodes must be >= 0 (0 = no limit)"
        )
        if self.loop_cores:
            self.loop_core_set()
        _require(self.http_port >= -1, "--http-port must be >= -1 (-1 = off, 0 = pick a free port)")
        _require(self.fronts >= 0, "--fronts must be >= 0 (0 = no front processes)")
        _require(
            bool(self.worker_tls_cert) == bool(self.worker_tls_key),
            "--worker-tls-cert and --worker-tls-key go together",
        )
        _require(
            not self.worker_tls_cert or bool(self.worker_tls_ca),
            "--worker-tls-cert needs --worker-tls-ca (mutual TLS is on top of TLS)",
        )


@dataclass(slots=True)
class FrontConfig:
    """`zerobubble front`: a process that owns client `Generate` calls and relays them to a
    scheduler over one stream (`scheduler_svc/front.py`), so that the scheduler's planning loop
    sends one message per loop turn instead of one per client reply."""

    log_level: str = setting("info", "logging verbosity", choices=LOG_LEVELS)
    host: str = setting("0.0.0.0", "address to bind the client gRPC server to")
    port: int = setting(50052, "client gRPC port (0 = pick a free port)")
    http_port: int = setting(-1, "OpenAI-compatible HTTP port on --host (-1 = off, 0 = pick a free port)")
    scheduler: str = setting("localhost:50051", "the scheduler to relay to, HOST:PORT")
    tls_cert: str = setting("", "PEM server certificate for clients; TLS is on when set", secret=True)
    tls_key: str = setting("", "PEM private key of --tls-cert", secret=True)
    auth_token: str = setting("", "bearer token clients must send (empty = no auth)", secret=True)
    scheduler_tls_ca: str = setting("", "PEM CA of the scheduler's certificate; TLS to it when set")
    scheduler_auth_token: str = setting("", "bearer token the scheduler requires of its clients", secret=True)
    event_loop: str = setting(
        "auto", "asyncio event loop: uvloop, the standard library's asyncio, or auto", choices=EVENT_LOOPS
    )
    cpu_affinity: str = setting("", "cores the front's process runs on (empty = any core)")
    drain_timeout: float = setting(60.0, "seconds SIGTERM lets running requests finish before cancelling the rest")
    reuse_port: bool = setting(
        False, "share --port with other fronts (SO_REUSEPORT): the kernel spreads client connections over them"
    )
    parent_pid: int = setting(
        0, "stop when this process is gone (a scheduler's --fronts set it: its fronts must not outlive it; 0 = off)"
    )

    def validate(self) -> None:
        _require(bool(self.tls_cert) == bool(self.tls_key), "--tls-cert and --tls-key go together")
        _require(0 <= self.port <= 65535, "--port must be a port number (0 = pick one)")
        _require(-1 <= self.http_port <= 65535, "--http-port must be -1 (off) or a port")
        _require(bool(self.scheduler.strip()), "--scheduler is required (HOST:PORT)")
        _require(self.drain_timeout >= 0, "--drain-timeout must be >= 0")
        if self.cpu_affinity:
            available_cores(self.cpu_affinity, "--cpu-affinity")
        check_event_loop(self.event_loop)


@dataclass(slots=True)
class ServeConfig:
    """`zerobubble serve`: a scheduler and, unless ``--workers`` is given, one local worker.

    The worker's listening settings are not flags of `serve`: it listens on loopback, on
    ``worker_port``, without TLS, and its figures reach the scheduler's metrics port.
    """

    scheduler: SchedulerServiceConfig
    worker: WorkerConfig
    worker_port: int = setting(
        0, "port of the local worker (0 = pick a free port); its metrics go to the scheduler's port"
    )

    def validate(self) -> None:
        self.scheduler.validate(needs_workers=False)
        if not self.scheduler.workers:
            self.worker.validate()


def check_scheduler_fits_worker(scheduler: SchedulerServiceConfig, worker: WorkerConfig) -> None:
    """:class:`ConfigError` when a scheduler may run more requests at once than a worker it
    drives has state slots for: it would be held below its own ``--max-num-seqs`` by that
    worker, which a deployment should say rather than find out."""
    _require(
        scheduler.max_num_seqs <= worker.max_num_seqs,
        f"max-num-seqs {scheduler.max_num_seqs} exceeds the {worker.max_num_seqs} of the worker",
    )


@dataclass(slots=True)
class SchedulerConfig:
    """Capacity and policy of one scheduler (one worker's KV cache).

    The worker-given fields (capacity, k, lookahead, EOS ids, vocabulary) are filled from the
    worker's `Describe` answer with `with_worker`; the policy fields come from the service's
    settings (`from_service`), whose defaults are also theirs.
    """

    num_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0
    max_num_seqs: int = default_of(SchedulerServiceConfig, "max_num_seqs")
    max_num_batched_tokens: int = default_of(SchedulerServiceConfig, "max_num_batched_tokens")
    num_spec_tokens: int = 0  # k draft slots per decode; 0 = no speculation
    # Draft slots a decode of a request with a predicted output may carry; 0 = predictions unused.
    num_prediction_tokens: int = 0
    # The worker's `--spec-method` ("suffix": the scheduler sends continuations, `scheduler_svc/suffix.py`).
    spec_method: str = "none"
    # Running requests from which decodes are planned without drafts; 0 = never.
    spec_disable_batch_size: int = default_of(SchedulerServiceConfig, "spec_disable_batch_size")
    # "adaptive": draft slots per row from acceptance and step cost (`scheduler_svc/draft_length.py`).
    spec_draft_length: str = default_of(SchedulerServiceConfig, "spec_draft_length")
    # Prompt tokens of a step that carries decodes; 0 = the whole token budget.
    max_prefill_tokens_with_decodes: int = default_of(SchedulerServiceConfig, "max_prefill_tokens_with_decodes")
    # Extra slots allocated past each step (a draft model writes its k-token chain there).
    num_lookahead_slots: int = 0
    # Tokens each query attends back when every layer is windowed (0: full attention); blocks
    # wholly behind the window of a running request's next step are freed (scheduler_svc/window.py).
    sliding_window: int = 0
    # One adaptive draft length for all rows of a plan: a CUDA worker replays its captured
    # graphs only for decode steps whose rows are all of one width.
    uniform_draft_length: bool = False
    enable_prefix_caching: bool = default_of(SchedulerServiceConfig, "enable_prefix_caching")
    max_waiting: int = default_of(SchedulerServiceConfig, "max_waiting")
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0  # valid prompt ids are below it; 0 = the tokenizer's vocabulary

    @classmethod
    def from_service(cls, cfg: SchedulerServiceConfig) -> SchedulerConfig:
        """The policy part of the scheduler service's settings (capacity comes from a worker)."""
        return cls(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching,
            max_waiting=cfg.max_waiting,
            spec_disable_batch_size=cfg.spec_disable_batch_size,
            spec_draft_length=cfg.spec_draft_length,
            max_prefill_tokens_with_decodes=cfg.max_prefill_tokens_with_decodes,
        )

    def with_worker(self, info: worker_pb2.WorkerInfo) -> SchedulerConfig:
        """A copy completed with a worker's capacity, speculation, EOS ids and vocabulary."""
        max_num_seqs = self.max_num_seqs
        if info.max_num_seqs > 0:
            max_num_seqs = min(max_num_seqs, info.max_num_seqs)
        return dataclasses.replace(
            self,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            max_num_seqs=max_num_seqs,
            num_spec_tokens=info.num_spec_tokens,
            num_prediction_tokens=info.num_prediction_tokens,
            spec_method=info.spec_method or "none",
            num_lookahead_slots=info.num_lookahead_slots,
            sliding_window=info.sliding_window,
            uniform_draft_length=info.device.startswith("cuda"),
            eos_token_ids=tuple(info.eos_token_ids),
            vocab_size=info.vocab_size,
        )

    def validate(self) -> None:
        """:class:`ConfigError` if a field is out of range (the worker-given ones must be set)."""
        for name in (
            "num_blocks",
            "block_size",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_waiting",
        ):
            _require(getattr(self, name) >= 1, f"SchedulerConfig.{name} must be positive")
        _require(
            min(self.num_spec_tokens, self.vocab_size, self.spec_disable_batch_size, self.sliding_window) >= 0,
            "SchedulerConfig.num_spec_tokens, vocab_size, spec_disable_batch_size and sliding_window must be >= 0",
        )
        _require(
            self.spec_draft_length in DRAFT_LENGTHS,
            f"SchedulerConfig.spec_draft_length must be one of {', '.join(DRAFT_LENGTHS)}",
        )


# Settings of a worker that `serve` does not expose: the local worker's own listener, its auth
# token (serve makes a fresh one per run; `--auth-token` on serve is the clients' token) and its
# process's cores (`--cpu-affinity` on serve binds the scheduler; the local worker runs on any).
# Nor does it span machines: its tensor-parallel ranks all run beside it.
SERVE_WORKER_HIDDEN = frozenset(
    {"host", "port", "metrics_port", "tls_cert", "tls_key", "tls_client_ca", "auth_token", "cpu_affinity"}
    | {"nnodes", "node_rank", "master_addr", "master_port"}
)


def service_settings(command: str) -> list[tuple[type, dataclasses.Field]]:
    """The settings of a service command as ``(config class, field)``, each name once.

    For ``serve`` the scheduler's come first and the worker's follow, minus those the two
    share (``--max-num-seqs`` is one flag for both) and the local worker's listener.
    """
    if command == "worker":
        return [(WorkerConfig, f) for f in dataclasses.fields(WorkerConfig)]
    if command == "scheduler":
        return [(SchedulerServiceConfig, f) for f in dataclasses.fields(SchedulerServiceConfig)]
    if command == "front":
        return [(FrontConfig, f) for f in dataclasses.fields(FrontConfig)]
    if command == "serve":
        out: list[tuple[type, dataclasses.Field]] = [
            (SchedulerServiceConfig, f) for f in dataclasses.fields(SchedulerServiceConfig)
        ]
        taken = {f.name for _, f in out} | SERVE_WORKER_HIDDEN
        out += [(WorkerConfig, f) for f in dataclasses.fields(WorkerConfig) if f.name not in taken]
        out += [(ServeConfig, f) for f in dataclasses.fields(ServeConfig) if "setting" in f.metadata]
        return out
    raise ValueError(f"not a service command: {command!r}")


def secret_settings() -> frozenset[str]:
    """Names of the settings that manifests must take from a Secret."""
    return frozenset(
        f.name
        for cls in (WorkerConfig, SchedulerServiceConfig, FrontConfig)
        for f in dataclasses.fields(cls)
        if setting_info(f).secret
    )


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The `serve` config from its parsed flags; the local worker listens on loopback."""
    worker = from_namespace(WorkerConfig, args)
    worker.host, worker.port, worker.metrics_port = "127.0.0.1", args.worker_port, -1
    worker.tls_cert = worker.tls_key = worker.tls_client_ca = worker.auth_token = ""
    return ServeConfig(
        scheduler=from_namespace(SchedulerServiceConfig, args), worker=worker, worker_port=args.worker_port
    )


def parse_cores(spec: str) -> frozenset[int]:
    """CPU core numbers from a list such as ``1``, ``2-7`` or ``0,2,4-5`` (as taskset reads them)."""
    cores: set[int] = set()
    for part in spec.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"{part.strip()!r} is not a core number or a range like 2-7")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"range {part.strip()!r} runs backwards")
        cores.update(range(first, last + 1))
    return frozenset(cores)


def available_cores(spec: str, flag: str) -> frozenset[int]:
    """The cores `spec` names (see :func:`parse_cores`), each one this process may run on;
    :class:`ConfigError` naming `flag` otherwise."""
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"{flag}: binding threads to cores needs Linux")
    try:
        cores = parse_cores(spec)
    except ValueError as exc:
        raise ConfigError(f"{flag} {spec!r}: {exc}") from None
    missing = cores - os.sched_getaffinity(0)
    _require(not missing, f"{flag} {spec}: cores {sorted(missing)} are not available here")
    return cores


def allowed_cores(cpu_affinity: str) -> frozenset[int]:
    """The cores the process runs on: those `--cpu-affinity` names, or all it may use."""
    return available_cores(cpu_affinity, "--cpu-affinity") if cpu_affinity else frozenset(os.sched_getaffinity(0))


def cores_within(spec: str, flag: str, cpu_affinity: str) -> tuple[frozenset[int], frozenset[int]]:
    """(the cores `spec` names, the process's other cores: those of `cpu_affinity`, or all it
    may run on); :class:`ConfigError` naming `flag` where `spec` names a core outside them."""
    cores = available_cores(spec, flag)
    allowed = allowed_cores(cpu_affinity)
    outside = cores - allowed
    _require(not outside, f"{flag} {spec}: cores {sorted(outside)} are outside --cpu-affinity")
    return cores, allowed - cores


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
