"""docs/cli.md lists every flag of every command, as the parser has it.

A flag added, renamed or reworded in the parser and not in the docs fails here. To bring the tables up to
date: `PDSERVE_UPDATE_DOCS=1 pytest tests/test_cli_docs.py`, then read the diff.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from pdserve.cli import build_parser

CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
_TABLE = re.compile(r"(\| flag \| what \|\n\| --- \| --- \|\n)((?:\|.*\n)*)")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its words: "up", "k8s render", "sim calibrate" …"""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {k}": v for k, v in _subparsers(sub).items()})
    return found


def _flag_rows(parser: argparse.ArgumentParser) -> str:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if not action.option_strings:  # a positional: its name alone
            usage = str(action.metavar or action.dest.upper())
        elif action.nargs == 0:
            usage = max(action.option_strings, key=len)
        elif action.choices is not None:
            usage = f"{max(action.option_strings, key=len)} {{{','.join(map(str, action.choices))}}}"
        else:
            usage = f"{max(action.option_strings, key=len)} {action.metavar or action.dest.upper()}"
        if action.nargs in ("+", "*"):
            usage += " …"
        what = (action.help or "") % {**vars(action), "prog": parser.prog}  # argparse's own expansion
        what = what.replace("|", "\\|")
        rows.append(f"| `{usage.replace('|', chr(92) + '|')}` | {what} |\n")
    return "".join(rows)


def _synced(doc: str) -> str:
    """The doc with each command's flag table (the first under its "## pdserve CMD" heading) rebuilt."""
    parsers = _subparsers(build_parser())
    sections = re.split(r"(?m)^(## pdserve .*\n)", doc)
    out = [sections[0]]
    for heading, body in zip(sections[1::2], sections[2::2], strict=True):
        words = heading.removeprefix("## pdserve ").strip()
        sub = parsers.get(words)
        if sub is not None:
            body = _TABLE.sub(lambda m, s=sub: m.group(1) + _flag_rows(s), body, count=1)  # type: ignore[misc]
        out += [heading, body]
    return "".join(out)


def test_docs_cli_lists_every_flag_of_every_command_as_the_parser_has_it() -> None:
    doc = CLI_DOC.read_text()
    synced = _synced(doc)
    if os.environ.get("PDSERVE_UPDATE_DOCS") == "1":
        CLI_DOC.write_text(synced)
    assert synced == doc, "docs/cli.md's flag tables differ from the parser: see this test's docstring"


def test_every_command_has_a_section_in_docs_cli() -> None:
    doc = CLI_DOC.read_text()
    commands = {w: p for w, p in _subparsers(build_parser()).items() if _flag_rows(p)}  # not bare groups
    missing = [w for w in commands if f"## pdserve {w}\n" not in doc]
    assert not missing, f"docs/cli.md has no section for: {missing}"
