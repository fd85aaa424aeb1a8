#!/usr/bin/env python
"""Write ``zerobubble/workloads/edits.jsonl``: requests whose reply repeats most of a text the client
already holds, each with the ``prediction`` that client would send (OpenAI's Predicted Outputs).

    python scripts/make_edits_workload.py                 # write the workload (about 6 minutes on 2 cores)
    python scripts/make_edits_workload.py --limit 4 --dry-run --show   # try the wording on 4 rows of each kind

Two kinds of rows, each a user asking for a small change and for the whole text back:

- ``code-edit``: a Python standard-library function read from this interpreter (none of those
  ``grounded.jsonl`` uses), with an instruction such as a rename or a docstring; the prediction
  is the function's source, the file being edited.
- ``doc-revision``: a short document written by the embedded model itself (greedy, so the same
  versions write the same text), with an instruction such as "fix the typo" or "change the port
  to 8080"; the prediction is the document.

``max_tokens`` is 1.3x the prediction's tokens, capped at 512, room to repeat it whole. The
script then answers every row with the embedded model, greedy, and prints how much of each
prediction the reply repeats in order (difflib's matching blocks over token ids): the share a
server could accept from the prediction, at most. On 2026-12-07 (Python 3.11.7, transformers
5.25.0): 0.645 of the code predictions' tokens, 0.828 of the documents', 0.706 over all rows.

The documents are cached by prompt in ``<zerobubble cache>/edits-workload-documents.json``, so
rewording an instruction does not write them again; delete it to write them afresh.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import json
import math
import re
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Runnable as `python scripts/make_edits_workload.py` from a checkout that is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zerobubble.bench import WORKLOADS_DIR  # noqa: E402

OUTPUT = WORKLOADS_DIR / "edits.jsonl"
MAX_TOKENS_CAP = 512
MAX_TOKENS_FACTOR = 1.3
DOCUMENT_MAX_TOKENS = 300

# (function, instruction): small edits a user asks of a file they have open.
CODE_EDITS: tuple[tuple[str, str], ...] = (
    ("textwrap.wrap", "Rename the parameter `width` to `max_width`."),
    ("textwrap.indent", "Add type hints to the signature: `text` and `prefix` are `str`, and it returns `str`."),
    ("shlex.split", "Change the default of `posix` to `False`."),
    ("shlex.quote", "Rename the parameter `s` to `text`."),
    ("fnmatch.fnmatch", "Rename the function to `matches`."),
    ("fnmatch.filter", "Rename the variable `result` to `matched`."),
    ("calendar.monthrange", "Rename the variable `ndays` to `num_days`."),
    ("calendar.timegm", "Rename the parameter `tuple` to `time_tuple`, since it shadows the built-in."),
    ("calendar.leapdays", "Add a comment above the return statement explaining the formula."),
    ("heapq._siftup", "Add a one-line docstring."),
    ("statistics.median", "Change the error message to 'median of empty data'."),
    ("statistics.mode", "Rename the variable `pairs` to `most_common`."),
    ("html.escape", "Rename the parameter `s` to `text`."),
    ("shutil.copy", "Rename the parameter `dst` to `destination`."),
    ("statistics.geometric_mean", "Add the return annotation `-> float`."),
    ("html.unescape", "Rename the parameter `s` to `text`."),
    ("glob._glob1", "Add a one-line docstring."),
    ("glob.escape", "Rename the parameter `pathname` to `path`."),
    ("secrets.token_hex", "Rename the parameter `nbytes` to `num_bytes`."),
    ("shutil._samefile", "Add a one-line docstring."),
    ("urllib.parse._splitport", "Add type hints: `host` is `str` and it returns `tuple[str, str | None]`."),
    ("quopri.needsquoting", "Rename the parameter `c` to `char`."),
    ("shutil.copyfileobj", "Rename the variable `buf` to `chunk`."),
    ("shutil.ignore_patterns", "Rename the inner function `_ignore_patterns` to `_ignore`."),
)

# The same marker in a document prompt and in its instruction: the name, number or date the
# instruction changes (checked to be in the document), or TYPO for a misspelling put in one word.
TYPO = "TYPO"


@dataclass(frozen=True, slots=True)
class DocumentTask:
    """A document for the model to write, and the revision a user then asks for."""

    slug: str
    prompt: str
    instruction: str
    must_contain: str = ""  # the text the instruction refers to; TYPO: a misspelling is put in


DOCUMENTS: tuple[DocumentTask, ...] = (
    DocumentTask(
        "lunch-email",
        "Write a short email to a colleague named Sarah inviting her to a team lunch on Friday.",
        "Make the tone more formal in the second paragraph.",
    ),
    DocumentTask(
        "port-notice",
        "Write a short paragraph for a README explaining that the Harbor server listens on port 5000 by default.",
        "Change the port to 8080.",
        "5000",
    ),
    DocumentTask(
        "lighthouse-story",
        "Write a short story about a lighthouse keeper named Tom.",
        "Rename Tom to Arthur everywhere.",
        "Tom",
    ),
    DocumentTask("bread-blog", "Write a short blog post about learning to bake bread.", TYPO, TYPO),
    DocumentTask(
        "water-bottle",
        "Write a short product description for a reusable water bottle.",
        "Add a title at the top.",
    ),
    DocumentTask(
        "office-closure",
        "Write a short announcement that the office will be closed for maintenance on March 3.",
        "Change the date from March 3 to March 10.",
        "March 3",
    ),
    DocumentTask(
        "cover-letter",
        "Write a short cover letter for a junior data analyst position.",
        "Add a sentence at the end of the first paragraph saying that I can start in June.",
    ),
    DocumentTask("aquarium-howto", "Write short instructions for setting up a home aquarium.", TYPO, TYPO),
    DocumentTask(
        "school-trip",
        "Write a short note to parents about a school trip to the science museum.",
        "Change the Science Museum to the History Museum.",
        "Science Museum",
    ),
    DocumentTask(
        "brightline",
        "Write a short paragraph describing Brightline, a command-line tool that resizes images.",
        "Rename Brightline to Lumina everywhere.",
        "Brightline",
    ),
    DocumentTask(
        "hiking-welcome",
        "Write a short welcome message for new members of a hiking club.",
        "Make the tone more formal in the second paragraph.",
    ),
    DocumentTask("lisbon-guide", "Write a short travel guide to Lisbon.", TYPO, TYPO),
)

# The instruction first and the file last: the 135M model then copies more of the file than
# when the file comes first (0.59 of its tokens against 0.44, over these rows).
CODE_REQUEST = (
    "{instruction} Reply with the complete updated file in a ```python block, keeping every other line "
    "exactly as it is.\n\n```python\n{text}\n```"
)
DOC_REQUEST = (
    "Here is a document:\n\n```markdown\n{text}\n```\n\n"
    "{instruction} Return the whole document with only that change, in a ```markdown block."
)


class Model:
    """The embedded model through transformers, in float32, greedy.

    Prompts run in batches of similar length, left-padded with the attention mask saying so,
    which two CPU cores finish several times sooner than one prompt at a time; a padded batch's
    sums may differ from a lone prompt's in the last bits, so a near-tie could go the other way
    (this measures the workload; the server's exactness is tested elsewhere)."""

    def __init__(self, batch_size: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from zerobubble.worker_svc.model_loader import resolve_model

        path = resolve_model("smollm2-135m")
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos_id = int(self.tokenizer.eos_token_id)

    def count(self, text: str) -> int:
        """Tokens of ``text`` alone (no special tokens)."""
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def replies(self, chats: list[list[dict[str, str]]], max_tokens: list[int]) -> list[str]:
        """The greedy reply to each chat, as the server would give it (template applied, EOS
        stops it, at most its ``max_tokens``)."""
        prompts = [
            list(
                self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            )
            for chat in chats
        ]
        order = sorted(range(len(chats)), key=lambda i: len(prompts[i]))
        out: dict[int, str] = {}
        for start in range(0, len(order), self.batch_size):
            group = order[start : start + self.batch_size]
            generated = self._generate([prompts[i] for i in group], max(max_tokens[i] for i in group))
            for i, ids in zip(group, generated):
                ids = ids[: max_tokens[i]]
                ids = ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids
                out[i] = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        return [out[i] for i in range(len(chats))]

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[self.eos_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.eos_id,
                eos_token_id=self.eos_id,
            )
        return [row.tolist() for row in out[:, width:]]


def function_source(qualname: str) -> str:
    """The source of a standard-library function of this interpreter, dedented, no trailing blank."""
    module, name = qualname.rsplit(".", 1)
    return textwrap.dedent(inspect.getsource(getattr(importlib.import_module(module), name))).rstrip() + "\n"


def misspell(text: str) -> tuple[str, str, str]:
    """``text`` with one word misspelled (two inner letters swapped), the misspelling and the word.

    The word is the first of eight letters or more in the second half, so the typo sits in text
    the reply must repeat around it."""
    half = len(text) // 2
    for match in re.finditer(r"\b[a-z]{8,}\b", text[half:]):
        word = match.group()
        if word[2] != word[3]:
            typo = word[:2] + word[3] + word[2] + word[4:]
            start = half + match.start()
            return text[:start] + typo + text[start + len(word) :], typo, word
    raise ValueError("no word to misspell in the document")


def tidy(text: str, cut_off: bool) -> str:
    """The document's lines up to the first that repeats an earlier line or sentence (a small
    model's greedy text falls into loops), less the last line when the reply was cut off in the
    middle of it."""
    lines = text.strip().split("\n")
    if cut_off:
        lines = lines[:-1]
    kept: list[str] = []
    seen: set[str] = set()
    for line in lines:
        sentences = [x.strip() for x in re.split(r"(?<=[.!?])\s+", line) if len(x.strip()) > 20]
        if line.strip() in seen or any(x in seen for x in sentences) or len(set(sentences)) < len(sentences):
            break
        seen.update(sentences)
        seen.add(line.strip() or "\n")  # blank lines may repeat
        kept.append(line.rstrip())
    return "\n".join(kept).strip() + "\n"


def revision(task: DocumentTask, text: str) -> tuple[str, str]:
    """(document, instruction): the document as the user holds it and the revision they ask for.

    Raises:
        ValueError: the document lacks what the instruction refers to (the model or its
            version changed; reword the task).
    """
    if task.must_contain == TYPO:
        text, typo, word = misspell(text)
        return text, f'Fix the typo "{typo}" (it should be "{word}").'
    if task.must_contain and task.must_contain not in text:
        raise ValueError(f"{task.slug}: the document does not mention {task.must_contain!r}:\n{text}")
    if "second paragraph" in task.instruction and "\n\n" not in text.strip():
        raise ValueError(f"{task.slug}: the document has no second paragraph:\n{text}")
    return text, task.instruction


def make_row(model: Model, kind: str, source: str, text: str, request: str) -> dict[str, Any]:
    """One workload row: the user's request and the text they would send as the prediction."""
    max_tokens = min(MAX_TOKENS_CAP, math.ceil(MAX_TOKENS_FACTOR * model.count(text)))
    return {
        "kind": kind,
        "source": source,
        "messages": [{"role": "user", "content": request}],
        "max_tokens": max_tokens,
        "prediction": text,
    }


def build_rows(model: Model, limit: int) -> list[dict[str, Any]]:
    """Code edits, then document revisions (``limit`` > 0: that many of each, for trying wording)."""
    rows = []
    for qualname, instruction in CODE_EDITS[: limit or None]:
        text = function_source(qualname)
        request = CODE_REQUEST.format(text=text.rstrip("\n"), instruction=instruction)
        rows.append(make_row(model, "code-edit", qualname, text, request))
    tasks = DOCUMENTS[: limit or None]
    errors = []
    for task, raw in zip(tasks, written_documents(model, [task.prompt for task in tasks])):
        cut_off = model.count(raw) >= DOCUMENT_MAX_TOKENS - 1
        try:
            text, instruction = revision(task, tidy(raw, cut_off))
        except ValueError as exc:
            errors.append(str(exc))
            continue
        request = DOC_REQUEST.format(text=text.rstrip("\n"), instruction=instruction)
        rows.append(make_row(model, "doc-revision", f"smollm2-135m:{task.slug}", text, request))
    if errors:
        raise ValueError("\n\n".join(errors))
    return rows


def written_documents(model: Model, prompts: list[str]) -> list[str]:
    """The model's greedy document for each prompt, kept in the user's cache by prompt so that
    rewording one instruction does not write every document again.

    One prompt at a time, unpadded: a document then does not depend on which others were
    written with it, so a fresh run writes the same ones."""
    from zerobubble.worker_svc.model_loader import cache_dir, write_atomic

    path = cache_dir() / "edits-workload-documents.json"
    cached: dict[str, str] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    missing = [p for p in prompts if p not in cached]
    if missing:
        chats = [[{"role": "user", "content": p}] for p in missing]
        cached.update((p, model.replies([chat], [DOCUMENT_MAX_TOKENS])[0]) for p, chat in zip(missing, chats))
        write_atomic(path, json.dumps(cached, indent=1, ensure_ascii=False))
    return [cached[p] for p in prompts]


def repeated_share(model: Model, prediction: str, reply: str) -> float:
    """Share of the prediction's tokens that the reply repeats in order (difflib matching blocks)."""
    predicted, replied = model.encode(prediction), model.encode(reply)
    blocks = difflib.SequenceMatcher(None, predicted, replied, autojunk=False).get_matching_blocks()
    return sum(block.size for block in blocks) / max(len(predicted), 1)


def measure(model: Model, rows: list[dict[str, Any]], show: bool) -> dict[str, list[float]]:
    """Each row's repeated share, by kind; ``show`` prints each request and reply."""
    shares: dict[str, list[float]] = {}
    replies = model.replies([row["messages"] for row in rows], [row["max_tokens"] for row in rows])
    for row, reply in zip(rows, replies):
        share = repeated_share(model, row["prediction"], reply)
        shares.setdefault(row["kind"], []).append(share)
        print(f"{row['kind']:13s} {row['source']:34s} {model.count(row['prediction']):4d} tokens  share {share:.2f}")
        if show:
            print(textwrap.indent(f"{row['messages'][0]['content']}\n--- reply ---\n{reply}\n", "    | "))
    return shares


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--limit", type=int, default=0, help="rows of each kind (0 = all)")
    parser.add_argument("--dry-run", action="store_true", help="measure without writing the file")
    parser.add_argument("--show", action="store_true", help="print each request and reply")
    parser.add_argument("--batch-size", type=int, default=12, help="prompts generated together")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    started = time.perf_counter()
    model = Model(args.batch_size)
    rows = build_rows(model, args.limit)
    if not args.dry_run:
        args.output.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        print(f"wrote {len(rows)} rows to {args.output}")
    shares = measure(model, rows, args.show)
    every = [s for values in shares.values() for s in values]
    for kind, values in shares.items():
        tokens = [model.count(r["prediction"]) for r in rows if r["kind"] == kind]
        print(
            f"{kind}: {len(values)} rows, mean prediction {sum(tokens) / len(tokens):.0f} tokens, "
            f"mean share repeated {sum(values) / len(values):.3f}"
        )
    print(f"all: mean share repeated {sum(every) / len(every):.3f}; {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
