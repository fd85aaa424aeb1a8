"""The shipped `agentic` workload: a coding agent's tool-calling loops (scripts/make_agentic_workload.py),
whose last request asks for what earlier turns already hold."""

from __future__ import annotations

import json
from collections import Counter

from zerobubble.bench import load_dataset, resolve_dataset, shipped_workloads


def raw_rows() -> list[dict]:
    return [json.loads(line) for line in resolve_dataset("agentic").read_text(encoding="utf-8").splitlines()]


def test_each_loop_reads_a_file_answers_and_asks_for_it_again() -> None:
    raw = raw_rows()
    rows = load_dataset("agentic")
    assert "agentic" in shipped_workloads() and len(rows) == len(raw)
    assert Counter(row.kind for row in rows) == {"agent-edit": 12, "agent-recap": 12}
    for row, obj in zip(rows, raw):
        messages = row.messages
        assert messages is not None and 0 < row.max_tokens <= 512
        roles = [m["role"] for m in messages]
        assert roles == ["system", "user", "assistant", "user", "assistant", "assistant", "user"], obj["source"]
        name = obj["source"].rsplit(".", 1)[1]
        # The tool result is the function's source, which the edit's reply rewrites.
        assert f"def {name}(" in messages[3]["content"]
        assert messages[4]["content"].strip(), "the agent's own turn (the embedded model's reply)"
        if row.kind == "agent-edit":
            assert f"complete updated `{name}`" in messages[-1]["content"]


def test_the_agentic_workload_holds_out_the_other_workloads_functions() -> None:
    def sources(name: str) -> set[str]:
        return {json.loads(line)["source"] for line in resolve_dataset(name).read_text(encoding="utf-8").splitlines()}

    agentic = sources("agentic")
    assert not agentic & (sources("grounded") | sources("edits"))
