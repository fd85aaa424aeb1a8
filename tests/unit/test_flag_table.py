"""docs/flags.md's flag tables are generated from the CLI and must not go stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerobubble.entrypoints.cli import build_parser
from zerobubble.tools import flag_table

ROOT = Path(__file__).resolve().parents[2]


def _readme_section() -> str:
    text = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    start, end = text.index(flag_table.BEGIN), text.index(flag_table.END)
    return text[start : end + len(flag_table.END)]


def test_readme_flag_table_is_current() -> None:
    assert _readme_section() == flag_table.render_section(), (
        f"docs/flags.md's flag table is stale: run `{flag_table.FIX_COMMAND}` and commit the result"
    )


@pytest.mark.parametrize("command", flag_table.SERVICE_COMMANDS + flag_table.CLIENT_COMMANDS)
def test_every_flag_of_every_command_is_in_the_table(command: str) -> None:
    section = _readme_section()
    sub = flag_table._subparsers(build_parser(env={}))[command]
    flags = [name for action in sub._actions for name in action.option_strings if name not in ("-h", "--help")]
    assert flags, command
    assert [f for f in flags if f"`{f}`" not in section] == []


def test_a_flag_shows_each_commands_own_default() -> None:
    rows = flag_table.collect_rows(flag_table.SERVICE_COMMANDS)
    (port,) = [r for r in rows if r.flag == "`--port`" and "worker" in r.defaults]
    assert port.defaults["worker"] != port.defaults["scheduler"]  # 50061 vs 50051
    (front_port,) = [r for r in rows if r.flag == "`--port`" and "front" in r.defaults]
    assert front_port.help != port.help and set(front_port.defaults) == {"front"}
    (inflight,) = [r for r in rows if r.flag == "`--max-inflight-steps`"]
    assert set(inflight.defaults) == {"serve", "scheduler"}
    (graphs,) = [r for r in rows if r.flag == "`--cuda-graphs` / `--no-cuda-graphs`"]
    assert graphs.defaults["worker"] in ("on", "off")


def test_defaults_ignore_the_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    before = flag_table.render_section()
    monkeypatch.setenv("ZEROBUBBLE_MAX_NUM_SEQS", "7")
    assert flag_table.render_section() == before


def test_check_fails_on_a_stale_readme_and_write_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{flag_table.BEGIN}\nold table\n{flag_table.END}\n\nafter\n", encoding="utf-8")
    assert flag_table.main(["--check", "--file", str(readme)]) == 1
    assert flag_table.FIX_COMMAND in capsys.readouterr().err
    assert flag_table.main(["--write", "--file", str(readme)]) == 0
    assert flag_table.main(["--check", "--file", str(readme)]) == 0
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("# title\n\n") and text.endswith("\n\nafter\n") and "old table" not in text


def test_a_readme_without_markers_is_an_error() -> None:
    with pytest.raises(ValueError, match="markers"):
        flag_table.replace_section("no markers here", flag_table.render_section())
