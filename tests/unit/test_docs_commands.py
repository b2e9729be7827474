"""Every `make` and `fedgate` command the docs show exists.

A reader copies commands from README.md, CONTRIBUTING.md and docs/*.md: a
renamed target or subcommand left behind in them fails there, at 3 a.m.
These tests read every inline code span and every line of every fenced
block that starts as a command does (`make ...`, `fedgate ...`, maybe
after `$ `, environment assignments or a path such as `.venv/bin/`) and
look each target up in the Makefile and each subcommand in the CLI's own
parser.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from fedgate.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

#: a command at the start of a span or line: `$ `, VAR=value assignments and a path may lead
COMMAND = re.compile(r"^(?:\$ )?(?:[A-Z_][A-Z0-9_]*=\S* )*(?:\S*/)?(make|fedgate)((?: \S+)*)$")


def shown_commands(text: str) -> list[tuple[str, list[str], str]]:
    """(tool, its words, the text shown) of each command in a Markdown text."""
    spans = re.findall(r"`([^`\n]+)`", text)
    spans += [
        line.strip()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        for line in block.splitlines()
    ]
    found = []
    for span in spans:
        m = COMMAND.match(span.split(" #", 1)[0].strip())
        if m:
            try:
                words = shlex.split(m.group(2))
            except ValueError:  # an unclosed quote: an excerpt, "..." in it
                words = m.group(2).split()
            found.append((m.group(1), words, span))
    return found


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers there only
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def unknown(
    tool: str, words: list[str], targets: set[str], cli: dict[str, argparse.ArgumentParser]
) -> str | None:
    """What of the command does not exist, or None."""
    if tool == "make":
        for word in words:
            if "=" in word or word.startswith("-") or word == "...":
                break  # variables and flags follow the targets
            if word not in targets:
                return f"make target {word!r}"
        return None
    if not words or words[0].startswith("-"):
        return None
    if words[0] not in cli:
        return f"fedgate subcommand {words[0]!r}"
    actions = subcommands(cli[words[0]])
    second = words[1] if len(words) > 1 else ""
    if actions and second and not second.startswith(("-", "<", "[")) and second != "...":
        wanted = second.split("|")  # `gateway add|remove`
        missing = [w for w in wanted if w not in actions]
        if missing:
            return f"fedgate {words[0]} {missing[0]!r}"
    return None


def test_every_command_the_docs_show_exists() -> None:
    targets = set(re.findall(r"^([a-zA-Z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    cli = subcommands(build_parser())
    shown, wrong = 0, []
    for doc in DOCS:
        for tool, words, text in shown_commands(doc.read_text()):
            shown += 1
            if (what := unknown(tool, words, targets, cli)) is not None:
                wrong.append(f"{doc.relative_to(ROOT)}: {text!r}: no {what}")
    assert shown > 100, f"only {shown} commands found in the docs: is the pattern still right?"
    assert not wrong, "\n".join(wrong)


def test_a_renamed_target_or_subcommand_is_caught() -> None:
    """The check itself: what it must flag, and what it must let through."""
    cli = subcommands(build_parser())
    targets = {"up", "query", "test"}
    text = (
        'Run `make up PROFILE=ha`, then `make query SQL="SHOW TABLES"`; `make upp` is a typo.\n'
        "```\n$ FEDGATE_PROFILE=ha .venv/bin/fedgate up\nfedgate devices add d1 --rotate\n"
        "fedgate devices enrol d1\nfedgate gateway add|remove eu-west-1\nfedgate stats\n```\n"
        "The log says `[warning] fedgate uplink batcher: ...`.\n"
    )
    verdicts = {shown: unknown(tool, words, targets, cli) for tool, words, shown in shown_commands(text)}
    assert verdicts == {
        "make up PROFILE=ha": None,
        'make query SQL="SHOW TABLES"': None,
        "make upp": "make target 'upp'",
        "$ FEDGATE_PROFILE=ha .venv/bin/fedgate up": None,
        "fedgate devices add d1 --rotate": None,
        "fedgate devices enrol d1": "fedgate devices 'enrol'",
        "fedgate gateway add|remove eu-west-1": None,
        "fedgate stats": "fedgate subcommand 'stats'",
    }
