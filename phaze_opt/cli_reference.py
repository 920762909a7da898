"""docs/cli.md, rendered from the parser `phaze-opt` really builds, so the reference cannot miss a flag.

Regenerate with `python -m phaze_opt.cli_reference > docs/cli.md`; tests/test_cli_reference.py fails
when the committed page and the parser disagree.

argparse offers no public way to walk a parser, so this reads its `_actions` and asks its
`HelpFormatter` for the same strings `--help` prints. The formatter gets a fixed width: argparse
otherwise wraps at the terminal's width (COLUMNS), and the page must not depend on who generated it.
"""

from __future__ import annotations

import argparse
import sys

from .cli import build_parser

REGENERATE = "python -m phaze_opt.cli_reference > docs/cli.md"
WIDTH = 10_000  # wider than any usage line: one line per command


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, in the order `--help` lists them."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            out += [(name, helps.get(name) or "", sub) for name, sub in action.choices.items()]
    return out


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return parser.formatter_class(prog=parser.prog, width=WIDTH)


def _usage(parser: argparse.ArgumentParser) -> str:
    fmt = _formatter(parser)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return fmt.format_help().strip()


def _code(text: str) -> str:
    """Code in a table cell: on one line, its pipes escaped (metavars such as NAME|PATH contain them)."""
    return "`" + " ".join(text.split()).replace("|", "\\|") + "`" if text else ""


def _prose(text: str) -> str:
    """Help text on one line; `<` escaped, or Markdown would take <output-dir> for an HTML tag and drop it."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def _invocation(fmt: argparse.HelpFormatter, action: argparse.Action) -> str:
    if action.option_strings:
        return fmt._format_action_invocation(action)
    return fmt._format_args(action, action.dest)  # a positional: as usage writes it (STUDY [STUDY ...])


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.default in ([], (), ""):
        return ""  # a switch, no value unless given, or an empty list a repeatable flag adds to
    value = action.default
    if isinstance(value, (list, tuple)):
        value = " ".join(str(v) for v in value)
    return _code(str(value))


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    fmt = _formatter(parser)
    rows = ["| option | choices | default | description |", "|---|---|---|---|"]
    for action in parser._actions:
        choices = " ".join(_code(str(c)) for c in action.choices) if action.choices else ""
        help_text = fmt._expand_help(action) if action.help else ""
        rows.append(f"| {_code(_invocation(fmt, action))} | {choices} | {_default(action)} | {_prose(help_text)} |")
    return rows


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page, Markdown, ending in one newline."""
    parser = parser or build_parser()
    subs = subcommands(parser)
    lines = [
        "# CLI reference",
        "",
        f"<!-- Generated from the argparse parser by `{REGENERATE}`; do not edit by hand.",
        "     tests/test_cli_reference.py fails when this page and the parser disagree. -->",
        "",
        _prose(parser.description or ""),
        "",
        "```",
        _usage(parser),
        "```",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`{name}`](#{parser.prog}-{name}) | {_prose(help_text)} |" for name, help_text, _ in subs]
    for name, _, sub in subs:
        lines += ["", f"## {parser.prog} {name}", "", _prose(sub.description or ""), "", "```", _usage(sub), "```", ""]
        lines += _options_table(sub)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
