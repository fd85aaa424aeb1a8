"""Tiny random Llama targets, a scheduler driving an in-process runner and an EAGLE head fitted to
the real model, for the proposers' tests."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.sim_worker import make_toy_tokenizer_json
from zerobubble.kernels._triton import KernelImpl
from zerobubble.request_options import StoppingOptions
from zerobubble.rows import result_rows
from zerobubble.scheduler_svc.scheduler import Scheduler, SchedulerConfig
from zerobubble.scheduler_svc.tokenizer import Tokenizer
from zerobubble.worker_svc.eagle import head_config
from zerobubble.worker_svc.model import build_model
from zerobubble.worker_svc.model_loader import LoadedModel
from zerobubble.worker_svc.proposers import Proposer
from zerobubble.worker_svc.proposers.eagle import ServingHead, serving_head
from zerobubble.worker_svc.runner import ModelRunner, RunnerConfig

VOCAB = 258  # the toy byte tokenizer's vocabulary
K = 3
# Seeded sampling with every control on: keyed acceptance must still give the unspeculated output.
SEEDED = dict(
    ignore_eos=True,
    temperature=0.8,
    top_p=0.95,
    top_k=40,
    min_p=0.02,
    repetition_penalty=1.2,
    frequency_penalty=0.4,
    presence_penalty=0.3,
    logit_bias={7: 3.0, 9: -4.0},
)


def loaded_model(
    hf: LlamaForCausalLM, dtype: torch.dtype = torch.float32, kernels: KernelImpl = None, eos: int = 256
) -> LoadedModel:
    """``hf``'s weights in our own forward, stopping at ``eos``."""
    model = build_model(hf.config, dtype, torch.device("cpu"), kernels=kernels)
    model.load_weights(hf.state_dict())
    return LoadedModel(
        name="tiny",
        path=Path("."),
        hf_config=hf.config,
        model=model,
        tokenizer_file=Path("tokenizer.json"),
        eos_token_ids=[eos],
        max_model_len=256,
    )


def hf_greedy(hf: LlamaForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def tiny_hf(seed: int, max_positions: int = 256, num_layers: int = 2) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def runner_and_scheduler(
    target: LlamaForCausalLM | LoadedModel, proposer: Proposer | None, spec_disable_batch_size: int = 0
) -> tuple[ModelRunner, Scheduler]:
    """A runner over ``target`` (a Hugging Face model, loaded in float32, or a loaded model) and its
    scheduler, with fixed draft lengths: these tests check the proposers' drafts, which random
    weights rarely get accepted, and adaptive lengths would plan few."""
    k = K if proposer is not None else 0
    runner = ModelRunner(
        target if isinstance(target, LoadedModel) else loaded_model(target),
        RunnerConfig(num_blocks=160, block_size=4, max_num_seqs=4, max_model_len=128, num_spec_tokens=k),
        proposer,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=160,
            block_size=4,
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            num_spec_tokens=k,
            num_lookahead_slots=k,
            spec_disable_batch_size=spec_disable_batch_size,
            spec_draft_length="fixed",
            enable_prefix_caching=True,
            vocab_size=VOCAB,
        ),
        Tokenizer(make_toy_tokenizer_json()),
    )
    return runner, scheduler


def drive(runner: ModelRunner, scheduler: Scheduler, window: int) -> tuple[dict[str, list[int]], int, int]:
    """Run the scheduler to the end with `window` plans in flight; (outputs, drafted, accepted)."""
    outputs: dict[str, list[int]] = {}
    drafted = accepted = 0
    inflight: deque = deque()
    while scheduler.has_unfinished() or inflight:
        while len(inflight) < window and (plan := scheduler.schedule()) is not None:
            inflight.append(runner.execute(plan))
        result = inflight.popleft().materialize(0.0, K)
        for entry in result_rows(result).values():
            drafted += entry.num_draft_tokens
            accepted += entry.num_accepted
        for event in scheduler.on_step_result(result):
            outputs.setdefault(event.req_id, []).extend(event.token_ids)
    return outputs, drafted, accepted


def prompts_sharing_a_prefix(seed: int, count: int) -> dict[str, list[int]]:
    """``count`` prompts of different lengths after a common 17-token prefix (prefix-cache hits)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (17,), generator=gen).tolist()
    return {f"r{i}": shared + torch.randint(0, 256, (3 + 9 * i,), generator=gen).tolist() for i in range(count)}


def drafts_after_every_step(
    runner: ModelRunner,
    scheduler: Scheduler,
    prompts: dict[str, list[int]],
    expected: Callable[[list[int], int], list[int]],
) -> tuple[int, int]:
    """Run the prompts synchronously (20 tokens each); after every step compare each row's drafts
    with ``expected(tokens so far, number of drafts)``. Returns (rows compared, rows equal)."""
    for rid, prompt in prompts.items():
        scheduler.add_request(rid, prompt, None, StoppingOptions(max_tokens=20, ignore_eos=True))
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    compared = agreed = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert plan is not None
        result = runner.execute(plan).materialize(0.0, K)
        runner.propose_next()
        for event in scheduler.on_step_result(result):
            outputs[event.req_id].extend(event.token_ids)
        for rid, info in runner.slots.items():
            num = int(runner.state.num_drafts[info.slot])
            if outputs[rid] and num > 0:
                compared += 1
                agreed += runner.state.drafts[info.slot, :num].tolist() == expected(prompts[rid] + outputs[rid], num)
    return compared, agreed


def eagle_head(target: LoadedModel, state: dict[str, torch.Tensor], quantization: str = "none") -> ServingHead:
    """The serving EAGLE-1 head with weights ``state`` over ``target``, its config the target's own
    one layer deep (as `zerobubble.worker_svc.eagle.save_head` writes it)."""
    head_json = head_config(target.hf_config.to_dict(), fc_bias="fc.bias" in state)
    return serving_head(head_json, state, target, quantization)


def copying_target_and_head(noise: float = 0.0) -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    """A one-layer target with unit-RMS embeddings and the EAGLE head that copies it: its greedy
    drafts are the target's own continuation (tests/inprocess/test_eagle_proposer.py explains
    why); ``noise`` perturbs the head's fusion so that some drafts are wrong."""
    hf = tiny_hf(0, num_layers=1)
    with torch.no_grad():
        embed = hf.model.embed_tokens.weight
        embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
    hidden = hf.config.hidden_size
    fc = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
    fc += noise * torch.randn(fc.shape, generator=torch.Generator().manual_seed(5))
    layer = {k.removeprefix("model."): v for k, v in hf.state_dict().items() if k.startswith("model.layers.0.")}
    del layer["layers.0.input_layernorm.weight"]
    return hf, {"fc.weight": fc, **layer}


@dataclass(frozen=True)
class Eagle3Shape:
    """A random EAGLE-3 head's shape over a target: a Llama layer of its own (with an
    intermediate size, norm epsilon and rope base unlike the target's, as releases may have)
    and a draft vocabulary. Builds the head's ``config.json`` in either format and its weights."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    draft_vocab: int
    eps: float = 1e-5
    rope_theta: float = 5000.0

    @classmethod
    def of(cls, target: Any, draft_vocab: int) -> Eagle3Shape:
        heads = target.num_attention_heads
        return cls(
            target.hidden_size, heads, target.num_key_value_heads, target.hidden_size // heads,
            target.intermediate_size - 16, target.vocab_size, draft_vocab,
        )  # fmt: skip

    def layer_config(self, **extra: object) -> dict:
        fields = dict(
            model_type="llama",
            hidden_size=self.hidden,
            intermediate_size=self.inter,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.eps,
            vocab_size=self.vocab,
            max_position_embeddings=256,
            rope_theta=self.rope_theta,
        )
        return fields | extra

    def release_config(self, **extra: object) -> dict:
        """An EAGLE-3 release's config.json (a Llama config with ``draft_vocab_size``)."""
        fields = dict(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=self.draft_vocab)
        return self.layer_config(**(fields | extra))

    def speculators_config(self, aux: list[int], **extra: object) -> dict:
        """The speculators format's config.json: the layer apart, the algorithm named."""
        return dict(
            architectures=["Eagle3Speculator"],
            speculators_model_type="eagle3",
            speculators_config={"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}},
            transformer_layer_config=self.layer_config(num_hidden_layers=1),
            draft_vocab_size=self.draft_vocab,
            eagle_aux_hidden_state_layer_ids=aux,
            **extra,
        )

    def weights(self, seed: int, prefix: str = "layers.0.", num_aux: int = 3) -> dict[str, torch.Tensor]:
        """Random weights, sharp enough that drafts are far from ties, the layer under ``prefix``
        (``midlayer.`` in EAGLE-3 releases); ``d2t`` maps to a random subset of the vocabulary."""
        gen = torch.Generator().manual_seed(seed)
        hidden, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim

        def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * scale

        def norm() -> torch.Tensor:
            return 1.0 + rand(hidden, scale=0.1)

        ids = torch.randperm(self.vocab, generator=gen)[: self.draft_vocab].sort().values
        return {
            "fc.weight": rand(hidden, num_aux * hidden, scale=0.15),
            prefix + "input_layernorm.weight": norm(),
            prefix + "hidden_norm.weight": norm(),
            prefix + "self_attn.q_proj.weight": rand(q, 2 * hidden),
            prefix + "self_attn.k_proj.weight": rand(kv, 2 * hidden),
            prefix + "self_attn.v_proj.weight": rand(kv, 2 * hidden),
            prefix + "self_attn.o_proj.weight": rand(hidden, q),
            prefix + "post_attention_layernorm.weight": norm(),
            prefix + "mlp.gate_proj.weight": rand(self.inter, hidden),
            prefix + "mlp.up_proj.weight": rand(self.inter, hidden),
            prefix + "mlp.down_proj.weight": rand(hidden, self.inter),
            "norm.weight": norm(),
            "lm_head.weight": rand(self.draft_vocab, hidden, scale=1.0),
            "d2t": ids - torch.arange(self.draft_vocab),
            "t2d": torch.zeros(self.vocab, dtype=torch.bool).index_fill_(0, ids, True),
        }


@torch.no_grad()
def fitted_head(model_dir: Path, prompts: list[list[int]], out_dir: Path) -> Path:
    """An EAGLE-1 head for the model in ``model_dir``, fitted in closed form instead of trained:
    its layer is the target's first with the attention and MLP outputs zeroed (so it passes its
    input through), and ``fc`` is the ridge regression from (embedding of token t + 1, final
    hidden state at t) to the final hidden state at t + 1 over the target's own forward of
    ``prompts``. A linear guess of the next state: its drafts are right now and then (about one
    in nine on the grounded rows), which exercises acceptance, rejection and partial acceptance
    over the real model in seconds; the trained head (scripts/train_eagle.py) is for speed,
    measured in benchmarks."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    embed = hf.model.embed_tokens.weight
    inputs, targets = [], []
    for ids in prompts:
        tokens = torch.tensor(ids)
        hidden = hf.model(tokens[None]).last_hidden_state[0]
        inputs.append(torch.cat((embed[tokens[1:]], hidden[:-1]), dim=-1))
        targets.append(hidden[1:])
    x, y = torch.cat(inputs).double(), torch.cat(targets).double()
    fc = torch.linalg.solve(x.T @ x + torch.eye(x.shape[1], dtype=x.dtype), x.T @ y).T
    layer = hf.state_dict().items()
    head = {k.removeprefix("model."): v.clone() for k, v in layer if k.startswith("model.layers.0.")}
    del head["layers.0.input_layernorm.weight"]  # EAGLE-1's layer has none
    head["layers.0.self_attn.o_proj.weight"].zero_()
    head["layers.0.mlp.down_proj.weight"].zero_()
    head["fc.weight"] = fc.float()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in head.items()}, str(out_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps(head_config(config, fc_bias=False), indent=2) + "\n")
    return out_dir
