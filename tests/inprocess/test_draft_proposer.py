"""The draft-model proposer's cache follows the target's, checked by a model drafting for itself.

A tiny random Llama is both target and draft. Greedy drafts of a model for itself are exactly
its own greedy continuation whenever the draft cache holds the right K/V at every position, so
nearly every draft must be accepted (a near-tie between the batched and single-token forwards is
the only excuse), and the output must equal Hugging Face's greedy tokens. The real scheduler
drives it with two plans in flight, chunked prefill (a small token budget), prefix-cache hits
(shared prompt prefixes) and requests finishing at different times.

A second tiny model of different weights drafts for the first to check keyed acceptance: with
seeded sampling and every sampling control on, each emitted token is the target's own keyed
sample, so the output equals the unspeculated one whatever the drafts and the plans look like.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from tests.support.drafting import SEEDED, K, drive, hf_greedy, loaded_model, runner_and_scheduler, tiny_hf
from tests.support.options import split_options
from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.worker_svc.proposers.draft import DraftModelProposer


@pytest.mark.parametrize("acceptance", ["keyed", "rejection"])
def test_self_drafting_accepts_its_own_greedy_continuation(acceptance: str) -> None:
    hf = tiny_hf(0)
    runner, scheduler = runner_and_scheduler(hf, DraftModelProposer(loaded_model(hf), K, acceptance))
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 256, (17,), generator=gen).tolist()
    prompts = {f"r{i}": shared + torch.randint(0, 256, (3 + 9 * i,), generator=gen).tolist() for i in range(5)}
    max_tokens = {rid: 12 + 5 * i for i, rid in enumerate(prompts)}
    for rid, prompt in prompts.items():
        scheduler.add_request(
            rid, prompt, SamplingOptions(seed=3), StoppingOptions(max_tokens=max_tokens[rid], ignore_eos=True)
        )
    outputs, drafted, accepted = drive(runner, scheduler, window=2)
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(hf, prompt, max_tokens[rid]), rid
    assert drafted > 50 and accepted >= 0.9 * drafted, (accepted, drafted)
    assert scheduler.stats.num_steps_completed > 0


def test_keyed_acceptance_gives_the_unspeculated_seeded_output() -> None:
    """A draft model with other weights (so drafts really are rejected) under keyed acceptance:
    seeded sampling with penalties, min_p, top-k/p and logit bias emits exactly the tokens of
    the same runner without speculation, sync or async, batched or alone; rejection sampling on
    the same drafts does not (it draws rejected positions from the residual)."""
    target, other = tiny_hf(0), tiny_hf(1)
    gen = torch.Generator().manual_seed(2)
    # Repeated prompt bytes give the penalties something to count from the start.
    prompts = {f"s{i}": (torch.randint(0, 256, (5 + 4 * i,), generator=gen).tolist() * 3) for i in range(3)}

    def run(acceptance: str | None, window: int, req_ids: list[str]) -> tuple[dict[str, list[int]], int, int]:
        proposer = DraftModelProposer(loaded_model(other), K, acceptance) if acceptance else None
        runner, scheduler = runner_and_scheduler(target, proposer)
        for rid in req_ids:
            scheduler.add_request(
                rid, prompts[rid], *split_options(dict(SEEDED, max_tokens=16, seed=100 + int(rid[1:])))
            )
        return drive(runner, scheduler, window)

    every = list(prompts)
    baseline, _, _ = run(None, 1, every)
    assert all(len(out) == 16 for out in baseline.values())
    for window in (1, 2):
        outputs, drafted, accepted = run("keyed", window, every)
        assert outputs == baseline, window
        assert 0 < accepted < drafted, (accepted, drafted)  # drafts were accepted and rejected
    assert run("keyed", 2, ["s1"])[0]["s1"] == baseline["s1"]  # alone
    rejection, _, _ = run("rejection", 2, every)
    assert rejection != baseline


def test_a_draft_covering_just_the_model_length_drafts_to_the_end() -> None:
    """The draft's rotary table ends at the model length (128): a request that runs to the end
    feeds its chain past it, which must not index the table (on CUDA a device-side assert that
    poisons the context); the output is still the target's greedy continuation. A draft that
    covers less than the model length is refused when it is bound."""
    target = tiny_hf(0)
    runner, scheduler = runner_and_scheduler(target, DraftModelProposer(loaded_model(tiny_hf(0, max_positions=128)), K))
    gen = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(0, 256, (20 + 7 * i,), generator=gen).tolist() for i in range(3)}
    for rid, prompt in prompts.items():
        scheduler.add_request(rid, prompt, None, StoppingOptions(ignore_eos=True))  # up to the model length
    outputs, drafted, accepted = drive(runner, scheduler, window=2)
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(target, prompt, 128 - len(prompt)), rid
    assert scheduler.stats.num_failed_steps == 0
    # Same weights: the drafts are the target's own tokens.
    assert drafted > 0 and accepted >= 0.9 * drafted, (accepted, drafted)
    with pytest.raises(ValueError, match="fewer than max_model_len 128"):
        runner_and_scheduler(target, DraftModelProposer(loaded_model(tiny_hf(0, max_positions=100)), K))


def test_kv_budget_counts_the_draft_cache_at_its_own_size() -> None:
    """The draft keeps a cache of its own shape block for block beside the target's: the blocks
    that fit are the budget over the sum of the two models' bytes per block (not twice the
    target's, which wasted most of the budget for a small draft beside a large target)."""
    from types import SimpleNamespace

    from zerobubble.config import WorkerConfig
    from zerobubble.worker_svc.model import kv_cache_bytes_per_block
    from zerobubble.worker_svc.server import kv_capacity_blocks

    big, small = tiny_hf(0).config, LlamaConfig(**{**tiny_hf(0).config.to_dict(), "num_hidden_layers": 1})
    cfg = WorkerConfig(dtype="float32", kv_cache_memory_gb=0.01, block_size=4)
    cpu = torch.device("cpu")
    per_big, per_small = (kv_cache_bytes_per_block(c, 4, torch.float32) for c in (big, small))
    assert per_small < per_big
    target, draft = SimpleNamespace(hf_config=big), SimpleNamespace(hf_config=small)
    budget = 0.01 * (1 << 30)
    assert kv_capacity_blocks(cfg, target, cpu, torch.float32) == int(budget // per_big)
    assert kv_capacity_blocks(cfg, target, cpu, torch.float32, draft) == int(budget // (per_big + per_small))


def test_kv_budget_on_cuda_leaves_room_for_a_full_steps_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the KV cache gets --gpu-memory-utilization of the device less what is in use and
    less a full step's logits and sampling (every sequence sampling 1 + k rows): sized from
    free memory alone, a full batch sampling with top-p ran out of memory mid-run."""
    from types import SimpleNamespace

    from zerobubble.config import WorkerConfig
    from zerobubble.worker_svc.model import kv_cache_bytes_per_block
    from zerobubble.worker_svc.sampler import PEAK_BYTES_PER_LOGIT
    from zerobubble.worker_svc.server import kv_capacity_blocks, step_reserve_bytes

    hf = tiny_hf(0).config
    target = SimpleNamespace(hf_config=hf)
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * gib, 24 * gib))
    cuda = torch.device("cuda")
    per_block = kv_cache_bytes_per_block(hf, 16, torch.bfloat16)
    cfg = WorkerConfig(max_num_seqs=256, spec_method="ngram", num_spec_tokens=3, gpu_memory_utilization=0.9)
    reserve = step_reserve_bytes(cfg, target)
    assert reserve == 256 * 4 * hf.vocab_size * PEAK_BYTES_PER_LOGIT
    # 0.9 of 24 GiB less the 4 GiB in use, less the reserve.
    budget = 20 * gib - 0.1 * 24 * gib - reserve
    assert kv_capacity_blocks(cfg, target, cuda, torch.bfloat16) == int(budget // per_block)
    # Without speculation a sequence samples one row.
    plain = WorkerConfig(max_num_seqs=256, spec_method="none", gpu_memory_utilization=0.9)
    assert step_reserve_bytes(plain, target) == reserve // 4
    # A reserve that leaves no room for the cache is refused with what to change.
    huge = SimpleNamespace(hf_config=SimpleNamespace(**{**hf.to_dict(), "vocab_size": 40_000_000}))
    with pytest.raises(ValueError, match="lower --max-num-seqs"):
        kv_capacity_blocks(cfg, huge, cuda, torch.bfloat16)


def test_the_result_copy_is_queued_before_the_draft_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the copier thread waits for the copy's event: queued after the draft model's
    k forwards, every step's result would wait for them as well."""
    hf = tiny_hf(0)
    proposer = DraftModelProposer(loaded_model(hf), K, "keyed")
    runner, scheduler = runner_and_scheduler(hf, proposer)
    calls: list[str] = []
    start_copy, propose = runner.copier.start, proposer.propose

    def logged_copy(outputs):
        calls.append("copy")
        return start_copy(outputs)

    def logged_propose(*args):
        calls.append("propose")
        propose(*args)

    monkeypatch.setattr(runner.copier, "start", logged_copy)
    monkeypatch.setattr(proposer, "propose", logged_propose)
    scheduler.add_request("r", list(range(1, 12)), None, StoppingOptions(max_tokens=10, ignore_eos=True))
    outputs, drafted, _ = drive(runner, scheduler, window=2)
    assert outputs["r"] == hf_greedy(hf, list(range(1, 12)), 10)
    assert drafted > 0 and calls.count("propose") >= 3
    # Each sampling step: its copy, then its drafts (the last step's are never asked for).
    num_proposals = calls.count("propose")
    assert calls[: 2 * num_proposals] == ["copy", "propose"] * num_proposals, calls
    assert calls[2 * num_proposals :] in ([], ["copy"]), calls


def test_drafts_come_after_the_result_and_stop_at_a_finish_notice() -> None:
    """A step's result is complete before its next drafts are made (`propose_next`, which the
    worker calls once the result is handed on), and a draft chain whose every request a later
    plan has finished stops there: the next request's prefill does not wait for it."""
    hf = tiny_hf(0)
    runner, scheduler = runner_and_scheduler(hf, DraftModelProposer(loaded_model(hf), K, "keyed"))
    prompt = list(range(1, 12))
    scheduler.add_request("r", prompt, None, StoppingOptions(max_tokens=10, ignore_eos=True))
    pending = runner.execute(scheduler.schedule())  # the prefill samples the first token
    slot = runner.slots["r"].slot
    assert int(runner.state.num_drafts[slot]) == 0  # no drafts yet ...
    events = scheduler.on_step_result(pending.materialize(0.0, K))
    assert events[0].token_ids == hf_greedy(hf, prompt, 1)  # ... and the result is whole
    runner.propose_next()
    assert int(runner.state.num_drafts[slot]) == K
    runner.propose_next()  # made once
    assert int(runner.state.num_drafts[slot]) == K

    decode = scheduler.schedule()
    pending = runner.execute(decode)
    scheduler.on_step_result(pending.materialize(0.0, K))
    num_cut = runner.notices.num_cut_drafts
    runner.note_finished(worker_pb2.StepPlan(step_id=decode.step_id + 1, finished_req_ids=["r"]))
    runner.propose_next()  # its drafts serve only "r", finished by a later plan
    assert runner.notices.num_cut_drafts == num_cut + 1
