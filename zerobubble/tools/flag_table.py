"""docs/flags.md's flag tables, generated from the CLI that `zerobubble.config` builds.

The service flags come from the config dataclasses (:func:`zerobubble.config.service_settings`),
the client flags from `zerobubble generate` and `zerobubble bench`; both are read from the
parser itself, so the table shows exactly what ``--help`` shows, each command's default
included. ``python -m zerobubble.tools.flag_table --write`` rewrites docs/flags.md between the
marker comments; ``--check`` (and ``tests/unit/test_flag_table.py``) fails while it is stale.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zerobubble.entrypoints.cli import build_parser

FLAGS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
BEGIN = "<!-- flag-table:begin (python -m zerobubble.tools.flag_table --write) -->"
END = "<!-- flag-table:end -->"
SERVICE_COMMANDS = ("serve", "worker", "scheduler", "front")
CLIENT_COMMANDS = ("generate", "bench")
FIX_COMMAND = "python -m zerobubble.tools.flag_table --write"
# `add_flag` appends the variable and the default to every help text; the table has columns for them.
_ENV_SUFFIX = re.compile(r"\s*\[env ZEROBUBBLE_[A-Z0-9_]+; default .*\]$", re.DOTALL)


@dataclass
class FlagRow:
    """One table row: a flag with one meaning, and its default in each command that takes it."""

    flag: str
    help: str
    defaults: dict[str, str] = field(default_factory=dict)


def _default_text(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.default in ("", [], None):
        return "—"
    return f"`{action.default}`"


def _flag_text(action: argparse.Action) -> str:
    return " / ".join(f"`{name}`" for name in action.option_strings)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise ValueError("the parser has no subcommands")


def collect_rows(commands: Sequence[str]) -> list[FlagRow]:
    """The flags of ``commands`` in declaration order; a flag whose help differs between
    commands (``--auth-token`` guards a worker but is what a scheduler's clients send) gets a
    row per meaning. Built with an empty environment, so ``ZEROBUBBLE_*`` variables of the
    machine running this do not leak into the defaults."""
    commands_by_name = _subparsers(build_parser(env={}))
    rows: dict[tuple[str, str], FlagRow] = {}
    for command in commands:
        for action in commands_by_name[command]._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or "--help" in action.option_strings:
                continue
            flag, help_text = _flag_text(action), _ENV_SUFFIX.sub("", action.help or "")
            row = rows.setdefault((flag, help_text), FlagRow(flag, help_text))
            row.defaults[command] = _default_text(action)
    return list(rows.values())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_table(commands: Sequence[str]) -> str:
    """A Markdown table: the flag, its default under each command that takes it, its help."""
    lines = [
        "| flag | " + " | ".join(f"`{c}`" for c in commands) + " | what it does |",
        "|---|" + "---|" * len(commands) + "---|",
    ]
    for row in collect_rows(commands):
        cells = [row.flag, *(row.defaults.get(c, "") for c in commands), row.help]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def render_section() -> str:
    """Everything between the markers: the service table, then the client table."""
    return "\n".join(
        [
            BEGIN,
            "",
            "Services (defaults per command; a blank cell: the command has no such flag):",
            "",
            render_table(SERVICE_COMMANDS),
            "",
            "Clients:",
            "",
            render_table(CLIENT_COMMANDS),
            "",
            END,
        ]
    )


def replace_section(text: str, section: str) -> str:
    """``text`` with the part from the begin marker to the end marker replaced by ``section``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the file lacks the flag-table markers {BEGIN!r} ... {END!r}")
    return text[:start] + section + text[end + len(END) :]


def main(argv: Sequence[str] | None = None) -> int:
    """``--write`` rewrites docs/flags.md's table; ``--check`` exits 1 when it is stale; neither prints it."""
    parser = argparse.ArgumentParser(prog="python -m zerobubble.tools.flag_table", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the section of docs/flags.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/flags.md's section is stale")
    parser.add_argument("--file", type=Path, default=FLAGS_PAGE, help="the file to read and rewrite")
    args = parser.parse_args(argv)
    section = render_section()
    if not (args.write or args.check):
        print(section)
        return 0
    text = args.file.read_text(encoding="utf-8")
    fresh = replace_section(text, section)
    if args.check:
        if fresh != text:
            print(f"{args.file}: the flag table is stale; run `{FIX_COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if fresh != text:
        args.file.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
