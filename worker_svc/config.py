"""The worker's configuration, importable without torch (`zerobubble serve` builds the local
worker's command line from it in the scheduler's process)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WorkerConfig:
    """Everything `zerobubble worker` is configured with (CLI flags, env fallbacks)."""

    model: str = "smollm2-135m"
    host: str = "0.0.0.0"
    port: int = 50061
    metrics_port: int = -1
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_model_len: int = 0
    spec_method: str = "none"
    num_spec_tokens: int = 3
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str = ""
    worker_id: str = ""
    num_threads: int = 0
    prepack_weights: bool = True
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_token: str = ""  # what the scheduler must send (its --worker-auth-token)
    drain_timeout: float = 30.0
