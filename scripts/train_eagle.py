"""Train an EAGLE-1 draft head for a target by self-distillation, then measure its acceptance offline.

    python scripts/train_eagle.py                       # the embedded SmolLM2-135M
    python scripts/train_eagle.py --model DIR --out DIR # another Llama/Qwen-family model

Three stages, each resumable: the target answers the workloads' prompts and its own user turns
(samples cached under ``OUT/data``), the head trains (checkpoint in ``OUT``), and the held-out
answers are walked step by step with the head's chain and with n-gram lookup (``--k``). The head
is written to ``OUT`` as bfloat16 ``model.safetensors`` + ``config.json`` (EAGLE-1 layout);
``OUT`` defaults to ``<model cache>/smollm2-135m-eagle``. The defaults take about an hour on two
CPU cores (SmolLM2-135M): about 22 minutes of data, 30 of training, 2 of evaluation.

    python scripts/train_eagle.py --eval-head DIR [--eval-data DIR] # evaluate a saved head only
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

# Runnable as `python scripts/train_eagle.py` from a checkout that is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zerobubble.tools.eagle_data import DistillSettings, Sample, build_dataset, load_sample  # noqa: E402
from zerobubble.tools.eagle_eval import EagleDrafter, ngram_drafter, simulate  # noqa: E402
from zerobubble.tools.eagle_train import TrainSettings, train  # noqa: E402
from zerobubble.worker_svc.eagle import (  # noqa: E402
    EagleHead,
    SharedWeights,
    draft_vocab,
    init_from_target_layer,
    load_draft_vocab,
    load_head,
    save_draft_vocab,
)
from zerobubble.worker_svc.model_loader import (  # noqa: E402
    EMBEDDED_MODEL_NAME,
    cache_dir,
    load_model,
    read_config,
    resolve_model,
)
from zerobubble.worker_svc.server import resolve_dtype  # noqa: E402

logger = logging.getLogger("train_eagle")


def target_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def shared_weights(state: dict[str, torch.Tensor]) -> SharedWeights:
    """The target's embedding and lm_head (the embedding again when tied), float32."""
    embed = state["model.embed_tokens.weight"].float()
    lm_head = state["lm_head.weight"].float() if "lm_head.weight" in state else embed
    return SharedWeights(embed=embed, lm_head=lm_head)


def load_split(data_dir: Path, split: str) -> list[Sample]:
    return [load_sample(p) for p in sorted((data_dir / split).glob("*.pt"))]


def evaluate(
    head: EagleHead, samples: list[Sample], ks: list[int], draft_ids: torch.Tensor | None
) -> dict[str, dict[str, object]]:
    """Per ``k``: accepted drafts per position and tokens per step, EAGLE's chain (drafting
    among ``draft_ids``, as served) and n-gram."""
    report: dict[str, dict[str, object]] = {}
    head.eval()
    for k in ks:
        for name, drafter in (("eagle", EagleDrafter(head, draft_ids)), ("ngram", ngram_drafter())):
            started = time.monotonic()
            acc = simulate(samples, drafter, k)
            report[f"{name} k={k}"] = {
                "tokens_per_step": round(acc.tokens_per_step, 3),
                "accepted_per_position": [round(r, 3) for r in acc.rates()],
                "steps": acc.steps,
                "seconds": round(time.monotonic() - started, 1),
            }
            logger.info("%s k=%d: %s", name, k, report[f"{name} k={k}"])
    return report


def parse_args() -> argparse.Namespace:
    defaults, data = TrainSettings(), DistillSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL_NAME)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--self-written", type=int, default=data.num_self_written, help="user turns the model writes")
    parser.add_argument(
        "--sampled-answers",
        type=int,
        default=data.num_sampled_answers,
        help="sampled answers per trained workload row, beside the greedy one",
    )
    parser.add_argument("--max-new-tokens", type=int, default=data.max_new_tokens)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-tokens", type=int, default=defaults.batch_tokens)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--token-weight", type=float, default=defaults.token_weight, help="weight of the token loss")
    parser.add_argument("--unroll", type=int, default=defaults.unroll, help="passes fed the head's own predictions")
    parser.add_argument("--max-minutes", type=float, default=0.0, help="stop training after this long (0: never)")
    parser.add_argument("--k", type=int, nargs="*", default=[3], help="draft lengths to evaluate")
    parser.add_argument(
        "--init-from-target",
        action="store_true",
        help="start the head's layer from the target's last layer (not EAGLE's recipe; worse on SmolLM2)",
    )
    parser.add_argument("--eval-limit", type=int, default=0, help="evaluate on at most this many held-out answers")
    parser.add_argument(
        "--eval-head", type=Path, default=None, help="only evaluate this saved head (no data, no training)"
    )
    parser.add_argument("--eval-data", type=Path, default=None, help="held-out answers from this data folder instead")
    parser.add_argument(
        "--train-dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the products' dtype in training (auto: bfloat16 where the CPU computes in it natively)",
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default, every core)")
    parser.add_argument(
        "--draft-vocab", type=int, default=8192, help="token ids the served head drafts from (its logits' rows)"
    )
    parser.add_argument(
        "--train-vocab",
        type=int,
        default=8192,
        help="token ids the loss compares distributions over (the draft vocabulary is its most frequent part)",
    )
    return parser.parse_args()


def train_head(args: argparse.Namespace, model_dir: Path, out: Path) -> dict[str, float]:
    """Stages 1 and 2: the self-distilled data under ``out/data`` and the trained head in ``out``."""
    started = time.monotonic()
    settings = DistillSettings(
        num_self_written=args.self_written,
        max_new_tokens=args.max_new_tokens,
        num_sampled_answers=args.sampled_answers,
    )
    build_dataset(model_dir, out / "data", settings)
    data_seconds = time.monotonic() - started
    train_samples = load_split(out / "data", "train")
    answer_tokens = sum(len(s.input_ids) - s.answer_start for s in train_samples)
    logger.info("%d training samples (%d answer tokens)", len(train_samples), answer_tokens)
    hf_config = read_config(model_dir)
    torch.manual_seed(0)
    state = target_state(model_dir)
    head = EagleHead(hf_config, shared_weights(state))
    if args.init_from_target:
        init_from_target_layer(head, state, hf_config.num_hidden_layers - 1)
    train_settings = TrainSettings(
        steps=args.steps,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        unroll=args.unroll,
        max_minutes=args.max_minutes,
        token_weight=args.token_weight,
        bf16=resolve_dtype(args.train_dtype, torch.device("cpu")) == torch.bfloat16,
    )
    raw_config = json.loads((model_dir / "config.json").read_text())
    # The ids the loss reads and the ids the served head drafts from: the training answers'
    # tokens by frequency (see `draft_vocab`), so the second are the most frequent of the first.
    # Both follow from the cached data alone, so a resumed run computes the same ones.
    answers = [s.input_ids[s.answer_start :] for s in train_samples]
    eos_ids = load_model(str(model_dir), weights=False).eos_token_ids
    train_size = min(args.train_vocab, hf_config.vocab_size)
    train_vocab = draft_vocab(answers, train_size, eos_ids)
    metrics = train(head, train_samples, out, train_settings, raw_config, train_vocab)
    logger.info("trained: %s", metrics)
    save_draft_vocab(out, draft_vocab(answers, min(args.draft_vocab, train_size), eos_ids))
    return metrics | {
        "train_samples": len(train_samples),
        "train_answer_tokens": answer_tokens,
        "data_seconds": round(data_seconds, 1),
    }


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    out = args.out or cache_dir() / "models" / f"{Path(args.model).name}-eagle"
    report: dict[str, object] = {}
    if args.eval_head is None:
        report["train"] = train_head(args, model_dir, out)
    head_dir = args.eval_head or out
    # The saved head as serving loads it: bfloat16 weights (computed in float32 here).
    head = load_head(head_dir, read_config(model_dir), shared_weights(target_state(model_dir)), torch.float32)
    held_out = load_split(args.eval_data or out / "data", "held_out")[: args.eval_limit or None]
    report["head"] = str(head_dir)
    report["held_out_samples"] = len(held_out)
    report["acceptance"] = evaluate(head, held_out, args.k, load_draft_vocab(head_dir))
    if args.eval_head is None:
        (out / "acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
