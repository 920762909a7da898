"""docs/cli.md is the parser, rendered: it fails when a flag changes and the page is not regenerated.

The second check walks the parser on its own (not through the renderer's helpers), so a renderer that
drops a flag, a subcommand, a choice or a help text fails here even when the page was regenerated.
"""

from __future__ import annotations

import argparse
import difflib
import re
from pathlib import Path

from phaze_opt.cli import build_parser
from phaze_opt.cli_reference import REGENERATE, render

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def test_docs_cli_md_is_the_parser_rendered():
    committed = PAGE.read_text() if PAGE.exists() else ""
    rendered = render()
    diff = "".join(list(difflib.unified_diff(committed.splitlines(True), rendered.splitlines(True),
                                             "docs/cli.md", "the parser now", n=1))[:40])
    assert committed == rendered, f"docs/cli.md is out of date; regenerate it with `{REGENERATE}`\n{diff}"


def _sections(page: str) -> dict[str, str]:
    parts = re.split(r"^## phaze-opt (\S+)$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _table_rows(section: str) -> list[list[str]]:
    """The cells of each option row (the usage block above the table names every flag too, so the
    check reads only the rows)."""
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def _as_written(text: str) -> str:
    """Help text as Markdown shows it verbatim: on one line, pipes and `<` escaped."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def test_the_page_lists_every_flag_of_every_subcommand():
    parser = build_parser()
    page = render(parser)
    sections = _sections(page)
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert subparsers, "the CLI has no subcommands"
    names = [name for group in subparsers for name in group.choices]
    assert list(sections) == names
    for group in subparsers:
        for name, sub in group.choices.items():
            section = sections[name]
            assert _as_written(sub.description) in section, f"{name}: description missing"
            rows = _table_rows(section)
            assert len(rows) == len(sub._actions), f"{name}: {len(rows)} rows for {len(sub._actions)} actions"
            for action in sub._actions:
                names_in_row = action.option_strings or [action.metavar or action.dest]
                row = next((r for r in rows if all(re.search(rf"(`|, ){re.escape(n)}[ ,`]", r[0]) for n in names_in_row)),
                           None)
                assert row is not None, f"{name}: no row for {names_in_row}"
                for choice in action.choices or ():
                    assert f"`{choice}`" in row[1], f"{name} {names_in_row}: choice {choice} missing"
                if action.required:
                    assert row[2] == "required", f"{name} {names_in_row}: not marked required"
                elif action.nargs != 0 and action.default not in (None, argparse.SUPPRESS, "") and action.default not in ([], ()):
                    default = action.default
                    shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
                    assert row[2] == f"`{shown}`", f"{name} {names_in_row}: default {shown!r} missing"
                assert row[3] == _as_written(action.help or ""), f"{name} {names_in_row}: help text missing or changed"


def test_the_page_does_not_depend_on_the_terminal_width(monkeypatch):
    """argparse wraps at COLUMNS; the page must be the same for whoever regenerates it."""
    monkeypatch.setenv("COLUMNS", "40")
    narrow = render(build_parser())
    monkeypatch.setenv("COLUMNS", "400")
    assert render(build_parser()) == narrow
