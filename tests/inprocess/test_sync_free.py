"""The accelerator step path never synchronises the host with the device, proven on the CPU.

Full worker steps (prefill chunks with and without sampling, decodes with n-gram, draft-model
and EAGLE-head drafts, keyed verification and rejection sampling, temperature/top-k/top-p rows, logprobs, a finish and
a new admission mid-stream) run on a tiny random-weight Llama whose every tensor is a
`FakeTensor` on the ``meta`` device, which the worker treats as an accelerator (anything but the
CPU; see `worker_svc/staging.py`). Fake tensors carry no data: `.item()`, `.tolist()`,
``int(t)`` or ``bool(t)`` raise `DataDependentOutputException`, and an op whose output shape
depends on values (``nonzero``, boolean masks, ``repeat_interleave`` without ``output_size``)
raises `DynamicOutputShapeException`. So a step that completes read nothing from the device.
Kernels pick their torch twins (``meta`` is not CUDA; Triton cannot run on fake tensors).

Why ``meta`` and not ``cuda``: on a CPU-only torch build a fake ``cuda`` tensor exists, but
``Tensor.__getitem__``, ``__setitem__``, ``copy_`` and ``to`` create a CUDA device guard in
their Python bindings before dispatch, which fails with "PyTorch is not linked with support for
cuda devices" — so indexing a fake CUDA tensor is impossible there. ``meta`` runs every op's
shape logic the same way.

`TransferAudit` records every host<->device copy of the steps: each must be ``non_blocking``
from (or into) memory allocated with ``pin_memory=True``. A pageable upload (``torch.tensor(list,
device=...)``, indexing a device tensor with a Python list) would show up here, and so would a
Python number written into a device tensor (``t[i] = 5``, ``t[index] = 5``): for a CUDA tensor
the binding builds the number as a host scalar and copies it to the device with a blocking copy,
a sync, while on ``meta`` the scalar is built on the device; the audit counts it as the upload
it is on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.support.hand_plans import Plans
from zerobubble.api import worker_pb2
from zerobubble.rows import add_continuations
from zerobubble.worker_svc.model import build_model
from zerobubble.worker_svc.model_loader import LoadedModel
from zerobubble.worker_svc.proposers import build_proposer
from zerobubble.worker_svc.runner import ModelRunner, RunnerConfig

aten = torch.ops.aten
K = 3
BLOCK_SIZE = 4


@dataclass(slots=True)
class Copy:
    """One host<->device copy seen during the steps."""

    direction: str  # "h2d" or "d2h"
    non_blocking: bool
    pinned: bool  # the host side was allocated with pin_memory=True


@dataclass(slots=True)
class TransferAudit(TorchDispatchMode):
    """Records host<->device copies and which host tensors were allocated pinned."""

    copies: list[Copy] = field(default_factory=list)
    pinned: dict[int, torch.Tensor] = field(default_factory=dict)  # id -> tensor (kept alive)
    # Python numbers made tensors by the binding (`t[i] = 5`; also `torch.where(m, t, 0)`, whose
    # number CUDA kernels take by value): id -> tensor (kept alive).
    numbers: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        TorchDispatchMode.__init__(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (aten.empty.memory_format, aten.empty_strided.default) and kwargs.get("pin_memory"):
            self.pinned[id(out)] = out
        elif (
            isinstance(out, torch.Tensor)
            and func._schema.returns
            and func._schema.returns[0].alias_info is not None
            and any(id(a) in self.pinned for a in args if isinstance(a, torch.Tensor))
        ):
            self.pinned[id(out)] = out  # a view or alias of pinned memory (torch.empty detaches)
        if func is aten.scalar_tensor.default:
            self.numbers[id(out)] = out
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if id(src) in self.numbers and dst.device.type != "cpu":
                # `t[i] = number`: on CUDA a blocking copy from a pageable host scalar.
                self.copies.append(Copy("h2d", non_blocking=False, pinned=False))
            else:
                self._record(src, dst, non_blocking)
        elif func is aten.index_put_.default and id(args[2]) in self.numbers and args[0].device.type != "cpu":
            # `t[index] = number`: on CUDA the number is moved to the device first, blocking.
            self.copies.append(Copy("h2d", non_blocking=False, pinned=False))
        elif func is aten._to_copy.default and "device" in kwargs:
            self._record(args[0], out, bool(kwargs.get("non_blocking", False)))
        return out

    def _record(self, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool) -> None:
        src_host, dst_host = src.device.type == "cpu", dst.device.type == "cpu"
        if src_host == dst_host:
            return
        host = src if src_host else dst
        self.copies.append(Copy("h2d" if src_host else "d2h", non_blocking, id(host) in self.pinned))


def _config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def _shapes(cfg: LlamaConfig) -> dict[str, torch.Size]:
    """Weight shapes from Hugging Face's own class, built on meta (outside the fake mode)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}


def _tiny_model(seed: int, cfg: LlamaConfig, shapes: dict[str, torch.Size]) -> LoadedModel:
    """A random-weight Llama on the fake device."""
    model = build_model(cfg, torch.float32, torch.device("meta"))
    model.load_weights({k: torch.randn(shape, device="meta") for k, shape in shapes.items()})
    return LoadedModel(
        name=f"tiny{seed}",
        path=Path("."),
        hf_config=cfg,
        model=model,
        tokenizer_file=Path("tokenizer.json"),
        eos_token_ids=[95],
        max_model_len=256,
    )


def _schedule(k: int, predicted: bool = False, suffix: bool = False) -> list[worker_pb2.StepPlan]:
    """``predicted``: a and c carry predicted outputs, and their decodes every draft slot;
    ``suffix``: suffix continuations arrive for a and b, later for c and d (a's cleared)."""
    p = Plans(k)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    wide = k if predicted or suffix else K
    a_pred, c_pred = ([7, 8, 5, 6, 7, 8, 1, 2, 3], [4, 4, 2, 9, 9]) if predicted else (None, None)
    plans = [
        # A non-sampling first chunk beside a one-chunk prompt that samples (greedy, logprobs).
        p.plan(
            p.new("a", prompt[:6], sample=False, prediction=a_pred),
            p.new("b", [1, 2, 3, 1, 2], sample=True, logprobs=True),
        ),
        # The rest of a's prompt (samples) beside b's first verification row.
        p.plan(p.chunk("a", prompt[6:]), p.decode("b")),
        p.plan(p.decode("a", wide), p.decode("b")),
        # Fewer draft slots than proposed; a random row (temperature, top-k, top-p) joins.
        p.plan(
            p.decode("a", 1), p.decode("b"), p.new("c", [9, 9, 9, 4], sample=True, temperature=0.8, prediction=c_pred)
        ),
        p.plan(p.decode("a", wide), p.decode("c", wide)),
        # b finished; a new request prefills beside decodes.
        p.plan(p.decode("a"), p.decode("c"), p.new("d", [3, 3, 3], sample=True, logprobs=True), finished=("b",)),
        p.plan(p.decode("a", 0), p.decode("c", wide), p.decode("d")),
        p.plan(p.decode("a", wide), p.decode("c"), p.decode("d")),
    ]
    if suffix:
        add_continuations(plans[2], ["a", "b"], [11, 6], [[7, 8, 5, 6, 7, 8, 5], [3, 1, 2]])
        add_continuations(plans[4], ["a", "c"], [13, 5], [[], [9, 9, 4, 9, 9, 9, 4, 1, 2]])
        add_continuations(plans[7], ["d", "gone"], [4, 9], [[3, 3], [1, 2, 3]])
    return plans


def _tiny_eagle_head(target: LoadedModel, shapes: dict[str, torch.Size]) -> object:
    """A random-weight EAGLE-1 head over ``target`` on the fake device."""
    from tests.support.drafting import eagle_head

    hidden = target.hf_config.hidden_size
    layer = {
        k.removeprefix("model."): torch.randn(shape, device="meta")
        for k, shape in shapes.items()
        if k.startswith("model.layers.0.") and "input_layernorm" not in k
    }
    state = {"fc.weight": torch.randn(hidden, 2 * hidden, device="meta"), **layer}
    return eagle_head(target, state)


def _eagle3_weights(target_config: LlamaConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """A random EAGLE-3 head's config and weights (made before the fake mode), drafting over the
    whole vocabulary: a ``d2t`` map is checked on the host once, when the head loads."""
    from tests.support.drafting import Eagle3Shape

    shape = Eagle3Shape.of(target_config, draft_vocab=target_config.vocab_size)
    weights = {k: v for k, v in shape.weights(4, num_aux=2).items() if k not in ("d2t", "t2d")}
    return shape.speculators_config([0, 1]), weights


@pytest.mark.parametrize(
    "spec",
    [
        "none",
        "ngram",
        "draft",
        "draft-rejection",
        "eagle",
        "eagle-rejection",
        "eagle3",
        # Suffix decoding: continuations from the plans, into the prediction buffers.
        "suffix",
        # With predicted outputs: alone, beside a proposer, verified by rejection sampling.
        "none+prediction",
        "ngram+prediction",
        "draft-rejection+prediction",
    ],
)
def test_steps_read_nothing_from_the_device(spec: str) -> None:
    from zerobubble.worker_svc.proposers.eagle import serving_head

    spec, _, with_predictions = spec.partition("+")
    configs = [_config(2), _config(1)]
    shapes = [_shapes(c) for c in configs]
    eagle3 = _eagle3_weights(configs[0]) if spec == "eagle3" else None
    with FakeTensorMode(allow_non_fake_inputs=True), torch.inference_mode():
        target = _tiny_model(0, configs[0], shapes[0])
        method, _, acceptance = spec.partition("-")
        draft = _tiny_model(1, configs[1], shapes[1]) if method == "draft" else None
        if method == "eagle":
            draft = _tiny_eagle_head(target, shapes[0])
        if eagle3 is not None:
            method, draft = "eagle", serving_head(*eagle3, target)
        proposer = build_proposer(method, K, draft_model=draft, draft_acceptance=acceptance or "keyed")
        runner = ModelRunner(
            target,
            RunnerConfig(
                num_blocks=64,
                block_size=BLOCK_SIZE,
                max_num_seqs=4,
                max_model_len=32,
                num_spec_tokens=K if proposer is not None else 0,
                num_prediction_tokens=6 if with_predictions or method == "suffix" else 0,
            ),
            proposer,
        )
        assert runner.copier.accelerator and not runner.builder.trim_empty_drafts
        replaced: list[list[int]] = []
        if method == "suffix":
            predictions = runner.predictions
            assert predictions is not None and predictions.dynamic
            replace = predictions.replace
            predictions.replace = lambda slots, *rest: (replaced.append(list(slots)), replace(slots, *rest))[1]
        audit = TransferAudit()
        pendings = []
        with audit:
            for plan in _schedule(runner.num_spec_tokens, bool(with_predictions), method == "suffix"):
                # Raises DataDependentOutputException / DynamicOutputShapeException on any read.
                pendings.append(runner.execute(plan))
    if method == "suffix":  # every continuation of a request held (not "gone") went in
        assert replaced == [[0, 1], [0, 2], [1]], replaced  # d took b's slot
    _assert_only_pinned_async_copies(audit, pendings)


def _assert_only_pinned_async_copies(audit: TransferAudit, pendings: list[Any]) -> None:
    """Every copy was non-blocking through pinned memory, and the downloads are the results alone."""
    uploads = [c for c in audit.copies if c.direction == "h2d"]
    downloads = [c for c in audit.copies if c.direction == "d2h"]
    assert uploads and all(c.non_blocking and c.pinned for c in uploads), uploads
    # The only device->host traffic is the result copy (tokens, counts, logprobs), async into
    # pinned memory; it is read later by `materialize` on the copier thread.
    assert downloads and all(c.non_blocking and c.pinned for c in downloads), downloads
    sampled_steps = [p.outputs for p in pendings if p.outputs is not None]
    assert len(sampled_steps) == len(pendings)
    num_result_tensors = sum(
        sum(
            t is not None
            for t in (
                o.tokens,
                o.num_accepted,
                o.num_verified,
                o.logprobs,
                o.top_ids,
                o.top_logprobs,
                o.prediction_drafts,
            )
        )
        for o in sampled_steps
    )
    assert len(downloads) == num_result_tensors
    assert all(o.tokens.device.type == "cpu" for o in sampled_steps)


def test_audit_catches_a_pageable_upload_and_a_read() -> None:
    """The instruments work: a plain `torch.tensor(..., device=)` upload and a number written
    into an element are flagged, `.item()` raises; `fill_` and a number operand are not."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.zeros(4, device="meta")
        audit = TransferAudit()
        with audit:
            x.copy_(torch.ones(4))  # pageable, blocking
            x[1] = 3.0  # on CUDA: a host scalar copied into the element, blocking
            x[torch.tensor([0, 2], device="meta")] = 1.0  # likewise, through index_put_
            x[2].fill_(3.0)  # a kernel with the number as its argument
            torch.where(x > 0, x, 0.0)  # likewise
        with pytest.raises(DataDependentOutputException):
            x.sum().item()
    assert [(c.direction, c.non_blocking, c.pinned) for c in audit.copies] == [("h2d", False, False)] * 3
