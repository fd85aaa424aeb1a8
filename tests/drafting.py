"""Tiny random Llama targets and a scheduler driving an in-process runner, for the proposers' tests."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.sim_worker import make_toy_tokenizer_json
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


def loaded_model(hf: LlamaForCausalLM) -> LoadedModel:
    model = build_model(hf.config, torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict())
    return LoadedModel(
        name="tiny",
        path=Path("."),
        hf_config=hf.config,
        model=model,
        tokenizer_file=Path("tokenizer.json"),
        eos_token_ids=[256],
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
    target: LlamaForCausalLM, proposer: Proposer | None, spec_disable_batch_size: int = 0
) -> tuple[ModelRunner, Scheduler]:
    k = K if proposer is not None else 0
    runner = ModelRunner(
        loaded_model(target),
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


def eagle_head(target: LoadedModel, state: dict[str, torch.Tensor]) -> ServingHead:
    """The serving EAGLE-1 head with weights ``state`` over ``target``, its config the target's own
    one layer deep (as `zerobubble.worker_svc.eagle.save_head` writes it)."""
    head_json = head_config(target.hf_config.to_dict(), fc_bias="fc.bias" in state)
    return serving_head(head_json, state, target)


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
