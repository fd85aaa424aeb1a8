"""docs/openai-api.md's rows of the request controls, generated from the request model.

A control declared on `SamplingOptions` or `StoppingOptions` with a `BodyParam` is a body
parameter of the OpenAI front (`zerobubble.scheduler_svc.openai_protocol`); its row (the example
the parameter test sends and the notes) is written here from that declaration, so adding a
control edits no table by hand. ``python -m zerobubble.tools.control_table --write`` rewrites
the doc between the marker comments; ``--check`` (and ``tests/unit/test_docs.py``) fails while it
is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zerobubble.request_options import SamplingOptions, StoppingOptions, wires

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-api.md"
BEGIN = "<!-- control-table:begin (python -m zerobubble.tools.control_table --write) -->"
END = "<!-- control-table:end -->"
FIX_COMMAND = "python -m zerobubble.tools.control_table --write"


def render_rows() -> list[str]:
    """One table row per body control, in declaration order (sampling, then stopping)."""
    rows = []
    for options in (SamplingOptions, StoppingOptions):
        for name, wire in wires(options):
            if wire.body is not None:
                example = json.dumps({name: wire.body.example})
                rows.append(f"| `{name}` | implemented | `{example}` | {wire.body.note} |")
    return rows


def render_section() -> str:
    """The marked section: a table of the controls under the doc's usual columns."""
    lines = [BEGIN, "", "| Parameter | Status | Example | Notes |", "|---|---|---|---|", *render_rows(), "", END]
    return "\n".join(lines)


def updated(text: str) -> str:
    """``text`` with its marked section replaced by the current one."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render_section() + text[end:]


def main(argv: list[str]) -> int:
    text = DOC.read_text(encoding="utf-8")
    if argv == ["--write"]:
        DOC.write_text(updated(text), encoding="utf-8")
        return 0
    if argv == ["--check"]:
        if updated(text) != text:
            print(f"{DOC.name}: the control table is stale: run `{FIX_COMMAND}`", file=sys.stderr)
            return 1
        return 0
    print("usage: python -m zerobubble.tools.control_table --write | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
