"""Random-weight models of real shapes, generated tokenizers, runners and the step driver the
sections share (nothing is downloaded)."""

from __future__ import annotations

import functools
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerobubble.request_options import SamplingOptions, StoppingOptions


def word_tokenizer_json(vocab_size: int) -> str:
    """A real `tokenizers` JSON whose ids 0..vocab_size-1 are the words ``t0``, ``t1``, ...

    Random-weight models emit any id of their vocabulary; every one of them must detokenize.
    The last id is the EOS token.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str()


def random_state_dict(hf_config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the shapes Hugging Face's class for ``hf_config`` declares.

    Built on the target device without instantiating the HF module, so a 1.7B-parameter model
    costs a second, not a minute of CPU initialisation.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {
            name: (tuple(p.shape), name.endswith("norm.weight"))
            for name, p in AutoModelForCausalLM.from_config(hf_config).state_dict().items()
        }
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, (shape, is_norm) in shapes.items():
        if is_norm:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        else:
            out[name] = 0.02 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        out[name] = out[name].to(dtype)
    return out


def write_model_dir(path: Path, hf_model: Any, vocab_size: int) -> Path:
    """A Hugging Face directory the worker can load: weights, config, generated tokenizer."""
    hf_model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, vocab_size)
    return path


def write_random_model_dir(path: Path, hf_config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Path:
    """A Hugging Face directory of random weights of ``hf_config``'s shape, written without
    instantiating the HF module (`random_state_dict`), so a 1.7B model takes seconds."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    weights = {name: t.contiguous().cpu() for name, t in random_state_dict(hf_config, device, dtype, seed).items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(path)
    _write_tokenizer(path, hf_config.vocab_size)
    return path


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    (path / "tokenizer.json").write_text(word_tokenizer_json(vocab_size))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def in_memory_model(hf_config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A `LoadedModel` with random weights of ``hf_config``'s shape (no files)."""
    from zerobubble.worker_svc.model import build_model
    from zerobubble.worker_svc.model_loader import LoadedModel

    model = build_model(hf_config, dtype, device)
    model.load_weights(random_state_dict(hf_config, device, dtype, seed))
    return LoadedModel(
        name="random",
        path=Path("."),
        hf_config=hf_config,
        model=model,
        tokenizer_file=Path("tokenizer.json"),
        eos_token_ids=[hf_config.vocab_size - 1],
        max_model_len=int(hf_config.max_position_embeddings),
    )


def tiny_config(family: str, **overrides: Any) -> Any:
    """A 2-layer random config of one family (the families of tests/inprocess/test_model_families.py)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    extra = {"mistral": dict(sliding_window=24), "qwen3": dict(head_dim=16)}.get(family, {})
    return cls(**common, **extra)


def qwen3_30b_a3b_config(dry_run: bool, num_layers: int = 8) -> Any:
    """Qwen3-30B-A3B's layer shape (hidden 2048, 32/4 heads of 128, 128 experts of 768, 8 per
    token), ``num_layers`` of its 48 layers; tiny in a dry run."""
    from transformers import Qwen3MoeConfig

    if dry_run:
        return Qwen3MoeConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False,
        )  # fmt: skip
    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=num_layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )  # fmt: skip


def qwen3_1p7b_config(dry_run: bool) -> Any:
    """Qwen3-1.7B's shape (28 layers, hidden 2048, 16/8 heads of 128, vocab 151936); tiny in a dry run."""
    from transformers import Qwen3Config

    if dry_run:
        return Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def make_scheduler(runner: Any, vocab_size: int) -> Any:
    """The real scheduler, configured from the runner as a worker link is from `Describe`,
    with a word-level tokenizer."""
    from zerobubble.tools.in_process import make_scheduler as in_process_scheduler

    return in_process_scheduler(runner, tokenizer=_word_tokenizer(vocab_size), max_num_batched_tokens=2048)


@functools.cache
def _word_tokenizer(vocab_size: int) -> Any:
    """One tokenizer per vocabulary size: Qwen3's 151936 words take seconds to build, and the
    throughput section drives dozens of runs."""
    from zerobubble.scheduler_svc.tokenizer import Tokenizer

    return Tokenizer(word_tokenizer_json(vocab_size))


@dataclass(slots=True)
class RunStats:
    """One driven workload."""

    output_tokens: int = 0
    wall_s: float = 0.0
    num_steps: int = 0
    gpu_busy_fraction: float | None = None


def drive(
    runner: Any, prompts: list[list[int]], max_tokens: int, window: int, around_step: Callable[[int], Any] | None = None
) -> RunStats:
    """Serve ``prompts`` (greedy, ignore EOS) keeping up to ``window`` plans ahead of results.

    This is the worker link's loop without gRPC: plan until the window is full, execute each
    plan at once, then hand the oldest result back. ``window=1`` is the synchronous baseline.
    On CUDA each step is bracketed by events; the busy fraction is the sum of the steps'
    GPU-timeline spans over the whole run's span (gaps are the device waiting for the host).
    ``around_step(i)`` returns a context manager wrapped around the i-th execute.
    """
    import contextlib

    scheduler = make_scheduler(runner, runner.loaded.hf_config.vocab_size)
    runner.reset()
    for i, prompt in enumerate(prompts):
        scheduler.add_request(
            f"r{i}",
            prompt,
            SamplingOptions(temperature=0.0, seed=i),
            StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
        )
    stats = RunStats()
    cuda = runner.device.type == "cuda"
    events: list[tuple[Any, Any]] = []
    inflight: deque = deque()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    while scheduler.has_unfinished() or inflight:
        while len(inflight) < window:
            plan = scheduler.schedule()
            if plan is None:
                break
            guard = around_step(stats.num_steps) if around_step else contextlib.nullcontext()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            with guard:
                inflight.append(runner.execute(plan))
            if cuda:
                end.record()
                events.append((begin, end))
            stats.num_steps += 1
        if not inflight:
            raise RuntimeError("scheduler stalled with unfinished requests and nothing in flight")
        result = inflight.popleft().materialize(0.0, runner.num_proposed)
        if result.error:
            raise RuntimeError(result.error)
        for event in scheduler.on_step_result(result):
            stats.output_tokens += len(event.token_ids)
    if cuda:
        torch.cuda.synchronize()
        busy = sum(b.elapsed_time(e) for b, e in events)
        span = events[0][0].elapsed_time(events[-1][1]) if events else 0.0
        stats.gpu_busy_fraction = busy / span if span > 0 else None
    stats.wall_s = time.perf_counter() - started
    return stats


def random_eagle_head(loaded: Any, seed: int = 1) -> Any:
    """A random-weight EAGLE-1 head at ``loaded``'s shape, in its dtype and on its device."""
    from tests.support.drafting import eagle_head  # the tests' head over a target, its config as saved

    cfg = loaded.hf_config
    one_layer = random_state_dict(cfg, loaded.model.device, loaded.model.dtype, seed)
    state = {
        name.removeprefix("model."): tensor
        for name, tensor in one_layer.items()
        if name.startswith("model.layers.0.") and "input_layernorm" not in name
    }
    gen = torch.Generator(device=loaded.model.device).manual_seed(seed)
    fc = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size, generator=gen, device=loaded.model.device)
    state["fc.weight"] = (fc * (2 * cfg.hidden_size) ** -0.5).to(loaded.model.dtype)
    return eagle_head(loaded, state)


def random_eagle3_head(loaded: Any, seed: int = 2, draft_vocab_size: int = 32000) -> Any:
    """A random-weight EAGLE-3 head (speculators format) at ``loaded``'s shape: three captured
    layers, a Llama layer over ``2 hidden`` inputs, its own lm_head over a draft vocabulary."""
    from zerobubble.worker_svc.proposers.eagle import serving_head

    cfg, device, dtype = loaded.hf_config, loaded.model.device, loaded.model.dtype
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    vocab = min(draft_vocab_size, cfg.vocab_size)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * shape[-1] ** -0.5).to(dtype)

    def norm() -> torch.Tensor:
        return torch.ones(hidden, device=device, dtype=dtype)

    aux = sorted({0, layers // 2, layers - 1})  # three layers where the target has them
    p = "layers.0."
    state = {
        "fc.weight": rand(hidden, len(aux) * hidden),
        p + "input_layernorm.weight": norm(),
        p + "hidden_norm.weight": norm(),
        p + "post_attention_layernorm.weight": norm(),
        p + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": rand(cfg.intermediate_size, hidden),
        p + "mlp.up_proj.weight": rand(cfg.intermediate_size, hidden),
        p + "mlp.down_proj.weight": rand(hidden, cfg.intermediate_size),
        "norm.weight": norm(),
        "lm_head.weight": rand(vocab, hidden),
        "d2t": torch.zeros(vocab, dtype=torch.int64),  # the first `vocab` target ids
    }
    layer = {
        "hidden_size": hidden,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    config = {
        "speculators_config": {"algorithm": "eagle3"},
        "transformer_layer_config": layer,
        "draft_vocab_size": vocab,
        "eagle_aux_hidden_state_layer_ids": aux,
    }
    return serving_head(config, state, loaded)


def build_runner(loaded: Any, spec: str, cuda_graphs: bool, num_blocks: int, max_num_seqs: int = 16) -> Any:
    """A runner over an already loaded model (several runners may share one model); ``eagle``
    and ``eagle3`` draft with a random-weight head of that layout."""
    from zerobubble.worker_svc.proposers import build_proposer
    from zerobubble.worker_svc.runner import ModelRunner, RunnerConfig

    heads = {"eagle": random_eagle_head, "eagle3": random_eagle3_head}
    draft_model = heads[spec](loaded) if spec in heads else None
    proposer = build_proposer("eagle" if spec in heads else spec, 3, draft_model=draft_model)
    config = RunnerConfig(
        num_blocks=num_blocks,
        block_size=16,
        max_num_seqs=max_num_seqs,
        max_model_len=1024,
        num_spec_tokens=3 if proposer is not None else 0,
        cuda_graphs=cuda_graphs,
    )
    return ModelRunner(loaded, config, proposer)


def repetitive_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts with repeated phrases, so prompt lookup finds drafts as it does on code and chat."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        phrases = [torch.randint(0, vocab_size - 1, (8,), generator=gen).tolist() for _ in range(4)]
        order = torch.randint(0, 4, (length // 8 + 1,), generator=gen).tolist()
        out.append([t for i in order for t in phrases[i]][:length])
    return out
