#!/usr/bin/env python
"""Write ``zerobubble/workloads/agentic.jsonl``: a coding agent's tool-calling loops, whose last
turn repeats what earlier turns said (the workload where suffix decoding pays).

    python scripts/make_agentic_workload.py            # write the workload (a few minutes on 2 cores)

Each conversation is about one standard-library function (none that ``grounded`` or ``edits``
uses): the user asks the agent to change it; the agent calls ``read_file`` (the loop's own
line, as an agent framework writes the call); the tool result is the function's source; the
agent's next turn is the embedded model's own greedy reply (at most 96 tokens); then a second
tool result and the last request, which the benchmark sends:

- ``agent-edit``: ``run_tests`` failed; "reply with the complete updated function": the reply
  rewrites the tool result (most of the file);
- ``agent-recap``: ``run_tests`` passed; "summarize what you did, quoting the lines you
  changed": the reply repeats the agent's own earlier turn and the code.

``max_tokens`` is 1.3x the function's tokens (at most 512) for edits, 192 for recaps.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "zerobubble" / "workloads" / "agentic.jsonl"
FUNCTIONS = (
    "textwrap.dedent",
    "textwrap.shorten",
    "copy.deepcopy",
    "glob.has_magic",
    "shlex.join",
    "calendar.isleap",
    "calendar.weekday",
    "statistics.fmean",
    "heapq.nlargest",
    "urllib.parse.urldefrag",
    "colorsys.rgb_to_hls",
    "difflib.get_close_matches",
)
SYSTEM = (
    "You are a coding agent working in a Python repository. Tools: read_file(path) returns a file, "
    'run_tests(path) runs its tests. Call a tool on a line of its own, e.g. CALL read_file("a.py"); '
    "its result comes back as the next message."
)


def edits_module() -> Any:
    """`scripts/make_edits_workload.py` (its model wrapper and source reader)."""
    spec = importlib.util.spec_from_file_location("make_edits_workload", ROOT / "scripts" / "make_edits_workload.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def opening(qualname: str, source: str) -> list[dict[str, str]]:
    """The conversation up to the agent's own reply: request, tool call, tool result."""
    module, name = qualname.rsplit(".", 1)
    path = module.replace(".", "/") + ".py"
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Add type hints to `{name}` in `{path}` and keep its behaviour."},
        {"role": "assistant", "content": f'CALL read_file("{path}")'},
        {"role": "user", "content": f"Tool result (read_file):\n```python\n{source}```"},
    ]


def closings(path: str, name: str) -> dict[str, list[dict[str, str]]]:
    """The last turns of each kind of row, after the agent's reply."""
    call = {"role": "assistant", "content": f'CALL run_tests("{path}")'}
    return {
        "agent-edit": [
            call,
            {
                "role": "user",
                "content": f"Tool result (run_tests): 1 failed: test_{name} - the file still has no type hints.\n"
                f"Reply with the complete updated `{name}` in a ```python block, every other line as it is.",
            },
        ],
        "agent-recap": [
            call,
            {
                "role": "user",
                "content": "Tool result (run_tests): all tests passed.\n"
                "Summarize what you found and what you changed, quoting the lines you changed.",
            },
        ],
    }


def build_rows() -> list[dict[str, Any]]:
    edits = edits_module()
    model = edits.Model(batch_size=12)
    sources = [edits.function_source(q) for q in FUNCTIONS]
    chats = [opening(q, s) for q, s in zip(FUNCTIONS, sources)]
    replies = model.replies(chats, [96] * len(chats))
    rows = []
    for qualname, source, chat, reply in zip(FUNCTIONS, sources, chats, replies):
        module, name = qualname.rsplit(".", 1)
        turns = [*chat, {"role": "assistant", "content": reply.strip()}]
        for kind, last in closings(module.replace(".", "/") + ".py", name).items():
            limit = min(512, math.ceil(1.3 * model.count(source))) if kind == "agent-edit" else 192
            rows.append({"kind": kind, "source": qualname, "messages": [*turns, *last], "max_tokens": limit})
    return rows


def main() -> int:
    rows = build_rows()
    OUT.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} rows to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
