"""CUDA graphs for decode-only steps: bucketing, padding rows and the replay/eager choice.

The capture itself needs CUDA (scripts/device_check.sh runs it on a GPU). Here the plain
functions are checked directly, and a runner with graphs *emulated* (the same padded static
buffers, run eagerly) must produce exactly what the eager runner produces, while replaying
every pure-decode step and none of the prefill or mixed ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.support.hand_plans import Plans
from zerobubble.rows import result_rows
from zerobubble.worker_svc.cuda_graphs import (
    GraphKey,
    batch_buckets,
    choose_graph,
    draft_widths,
    num_scratch_blocks,
    padding_rows,
)
from zerobubble.worker_svc.model import build_model
from zerobubble.worker_svc.model_loader import LoadedModel
from zerobubble.worker_svc.proposers import build_proposer
from zerobubble.worker_svc.runner import ModelRunner, RunnerConfig


def test_batch_buckets() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(4) == (1, 2, 4)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    with pytest.raises(ValueError):
        batch_buckets(0)
    assert draft_widths(0) == (1,) and draft_widths(3) == (1, 2, 3, 4)


def test_choose_graph_replays_only_uniform_decode_steps() -> None:
    buckets, widths = batch_buckets(16), draft_widths(3)
    assert choose_graph([4, 4, 4], [True] * 3, buckets, widths) == GraphKey(4, 4)
    assert choose_graph([1] * 9, [True] * 9, buckets, widths) == GraphKey(16, 1)
    assert choose_graph([1], [True], buckets, widths) == GraphKey(1, 1)
    assert choose_graph([4, 4, 17], [True, True, False], buckets, widths) is None  # a prefill chunk
    assert choose_graph([4, 2, 4], [True] * 3, buckets, widths) is None  # mixed widths
    assert choose_graph([6, 6], [True] * 2, buckets, widths) is None  # width never captured
    assert choose_graph([1] * 17, [True] * 17, buckets, widths) is None  # more rows than any bucket
    assert choose_graph([], [], buckets, widths) is None


def test_padding_rows_stay_in_scratch_blocks() -> None:
    block_size, scratch, max_blocks = 4, 100, 5
    pad = padding_rows(GraphKey(4, 3), 1, block_size, scratch, max_blocks)
    assert pad.positions == [0, 1, 2] * 3 and pad.input_ids == [0] * 9 and pad.seq_lens == [3] * 3
    assert pad.slot_mapping == [400, 401, 402] * 3
    assert pad.block_table_row == [100] * 5
    # A row wider than a block spans several scratch blocks.
    assert num_scratch_blocks(6, block_size) == 2
    wide = padding_rows(GraphKey(2, 6), 1, block_size, scratch, max_blocks)
    assert wide.slot_mapping == [400, 401, 402, 403, 404, 405]
    assert wide.block_table_row[:2] == [100, 101]
    assert padding_rows(GraphKey(2, 6), 2, block_size, scratch, max_blocks).positions == []
    with pytest.raises(ValueError):
        padding_rows(GraphKey(2, 1), 3, block_size, scratch, max_blocks)


def _tiny_loaded() -> LoadedModel:
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    model.load_weights(hf.state_dict())
    return LoadedModel(
        name="tiny",
        path=Path("."),
        hf_config=cfg,
        model=model,
        tokenizer_file=Path("tokenizer.json"),
        eos_token_ids=[95],
        max_model_len=256,
    )


def _eagle_head(loaded: LoadedModel) -> object:
    """A random-weight EAGLE-1 head over ``loaded`` (seeded: the same head for both runs)."""
    from tests.support.drafting import eagle_head
    from zerobubble.worker_svc.eagle import EagleHead, SharedWeights

    cfg = loaded.hf_config
    torch.manual_seed(1)
    unused = torch.zeros(cfg.vocab_size, cfg.hidden_size)  # serving reads the target's own
    return eagle_head(loaded, EagleHead(cfg, SharedWeights(embed=unused, lm_head=unused)).state_dict())


def _draft_model(loaded: LoadedModel, spec: str) -> object:
    """A random-weight EAGLE-1 (``eagle``) or EAGLE-3 (``eagle3``: two captured layers) head."""
    from tests.support.drafting import Eagle3Shape
    from zerobubble.worker_svc.proposers.eagle import serving_head

    if spec == "eagle":
        return _eagle_head(loaded)
    if spec == "eagle3":
        shape = Eagle3Shape.of(loaded.hf_config, draft_vocab=64)
        return serving_head(shape.speculators_config([0, 1]), shape.weights(3, num_aux=2), loaded)
    return None


def _run(loaded: LoadedModel, spec: str, graphs: bool) -> tuple[list, ModelRunner]:
    method = "eagle" if spec.startswith("eagle") else spec
    proposer = build_proposer(method, 3, draft_model=_draft_model(loaded, spec))
    runner = ModelRunner(
        loaded,
        RunnerConfig(
            num_blocks=64, block_size=4, max_num_seqs=8, max_model_len=32, num_spec_tokens=3, cuda_graphs=graphs
        ),
        proposer,
    )
    runner.builder.trim_empty_drafts = False  # the accelerator's shapes: every decode feeds 1 + k slots
    k = runner.num_spec_tokens
    p = Plans(k)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    plans = [
        p.plan(p.new("a", prompt, sample=True, logprobs=True), p.new("b", [1, 2, 3, 1, 2, 3], sample=True)),
        p.plan(p.decode("a"), p.decode("b")),  # 2 rows: bucket 2
        p.plan(p.decode("a"), p.decode("b"), p.new("c", [9, 4, 9, 4, 9], sample=True)),  # mixed: eager
        p.plan(p.decode("a"), p.decode("b"), p.decode("c")),  # 3 rows: bucket 4, one padding row
        p.plan(p.decode("a"), p.decode("b", 1), p.decode("c")),  # mixed widths: eager
        p.plan(p.decode("a"), p.decode("c"), finished=("b",)),
        p.plan(p.decode("a"), p.decode("c")),
    ]
    results = []
    for plan in plans:
        result = runner.execute(plan).materialize(0.0, k)
        results.append(
            [(req_id, r.token_ids, list(r.logprobs), r.num_accepted) for req_id, r in result_rows(result).items()]
        )
    return results, runner


@pytest.mark.parametrize("spec", ["none", "ngram", "eagle", "eagle3"])
def test_emulated_graph_replay_matches_eager(spec: str) -> None:
    loaded = _tiny_loaded()
    eager, _ = _run(loaded, spec, graphs=False)
    graphed, runner = _run(loaded, spec, graphs=True)
    assert runner.graphs is not None and runner.graphs.num_replays == (5 if spec == "none" else 4)
    for step_eager, step_graphed in zip(eager, graphed, strict=True):
        for (rid, toks, lps, acc), (rid2, toks2, lps2, acc2) in zip(step_eager, step_graphed, strict=True):
            assert (rid, toks, acc) == (rid2, toks2, acc2)
            assert lps == pytest.approx(lps2, abs=1e-4)
