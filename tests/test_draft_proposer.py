"""The draft-model proposer's cache follows the target's, checked by a model drafting for itself.

A tiny random Llama is both target and draft. Greedy drafts of a model for itself are exactly
its own greedy continuation whenever the draft cache holds the right K/V at every position, so
nearly every draft must be accepted (a near-tie between the batched and single-token forwards is
the only excuse), and the output must equal Hugging Face's greedy tokens. The real scheduler
drives it with two plans in flight, chunked prefill (a small token budget), prefix-cache hits
(shared prompt prefixes) and requests finishing at different times.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.tokenizer import Tokenizer
from tests.sim_worker import make_toy_tokenizer_json
from worker_svc.model import build_model
from worker_svc.model_loader import LoadedModel
from worker_svc.proposers.draft import DraftModelProposer
from worker_svc.runner import ModelRunner, RunnerConfig

VOCAB = 258  # the toy byte tokenizer's vocabulary
K = 3


def _loaded(hf: LlamaForCausalLM) -> LoadedModel:
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


def _hf_greedy(hf: LlamaForCausalLM, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_self_drafting_accepts_its_own_greedy_continuation() -> None:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    runner = ModelRunner(
        _loaded(hf),
        RunnerConfig(num_blocks=160, block_size=4, max_num_seqs=4, max_model_len=128, num_spec_tokens=K),
        DraftModelProposer(_loaded(hf), K),
    )
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=160,
            block_size=4,
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            num_spec_tokens=K,
            num_lookahead_slots=K,
            enable_prefix_caching=True,
            vocab_size=VOCAB,
        ),
        Tokenizer(make_toy_tokenizer_json()),
    )
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 256, (17,), generator=gen).tolist()
    prompts = {f"r{i}": shared + torch.randint(0, 256, (3 + 9 * i,), generator=gen).tolist() for i in range(5)}
    max_tokens = {rid: 12 + 5 * i for i, rid in enumerate(prompts)}
    for rid, prompt in prompts.items():
        scheduler.add_request(rid, prompt, max_tokens=max_tokens[rid], ignore_eos=True, seed=3)
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    drafted = accepted = 0
    inflight: deque = deque()
    while scheduler.has_unfinished() or inflight:
        while len(inflight) < 2 and (plan := scheduler.schedule()) is not None:
            inflight.append(runner.execute(plan))
        result = inflight.popleft().materialize(0.0, K)
        for entry in result.results:
            drafted += entry.num_draft_tokens
            accepted += entry.num_accepted
        for event in scheduler.on_step_result(result):
            outputs[event.req_id].extend(event.token_ids)
    for rid, prompt in prompts.items():
        assert outputs[rid] == _hf_greedy(hf, prompt, max_tokens[rid]), rid
    assert drafted > 50 and accepted >= 0.9 * drafted, (accepted, drafted)
    assert scheduler.stats.num_steps_completed > 0
