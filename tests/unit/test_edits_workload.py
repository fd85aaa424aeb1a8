"""The shipped `edits` workload: code edits and document revisions, each with the prediction its
client would send (the text being edited), which `zerobubble bench` sends as the request's
predicted output."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from zerobubble.bench import load_dataset, resolve_dataset, row_request, shipped_workloads


def raw_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in resolve_dataset(name).read_text(encoding="utf-8").splitlines()]


def test_the_edits_workload_carries_the_file_each_client_would_send() -> None:
    raw = raw_rows("edits")
    rows = load_dataset("edits")
    assert "edits" in shipped_workloads() and len(rows) == len(raw)
    kinds = Counter(row.kind for row in rows)
    assert set(kinds) == {"code-edit", "doc-revision"} and kinds["code-edit"] >= 20 and kinds["doc-revision"] >= 10
    for row, obj in zip(rows, raw):
        assert isinstance(row.prediction, str) and row.prediction.strip(), obj["source"]
        assert row.messages is not None and 0 < row.max_tokens <= 512
        # The request shows the user the very text they send as the prediction.
        assert row.prediction.strip() in row.messages[-1]["content"], obj["source"]
        if row.kind == "code-edit":
            # The prediction is the named standard-library function's source: it compiles and defines it.
            namespace: dict[str, object] = {}
            exec(compile(row.prediction, obj["source"], "exec"), {"__name__": "edit"}, namespace)
            assert list(namespace) == [obj["source"].rsplit(".", 1)[1]]


def test_the_edits_workload_holds_out_the_grounded_functions() -> None:
    def code_sources(name: str) -> set[str]:
        return {obj["source"] for obj in raw_rows(name) if obj["kind"] == "code-edit"}

    edits, grounded = code_sources("edits"), code_sources("grounded")
    assert len(edits) >= 20 and len(grounded) == 24
    assert edits.isdisjoint(grounded)
    assert {s.rsplit(".", 1)[1] for s in edits}.isdisjoint({s.rsplit(".", 1)[1] for s in grounded})


def test_every_reply_has_room_to_repeat_its_prediction(smollm2_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    for row in load_dataset("edits"):
        assert row.prediction is not None
        predicted = len(tokenizer.encode(row.prediction, add_special_tokens=False).ids)
        assert predicted <= row.max_tokens <= 512, (row.index, predicted, row.max_tokens)
        request = row_request(row)
        assert request.prediction.text == row.prediction and request.stopping.max_tokens == row.max_tokens
