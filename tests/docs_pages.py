"""The README and the docs pages as a reader meets them: their steps in order (a bash command, a console
block, a python block), and a console block's `$ COMMAND` lines with the lines each prints.

tests/test_readme.py types every step in order, except those a feature test types itself
(its RUN_BY_THEIR_OWN_TEST, whose steps it checks are still on the pages): such a test types a
console block with ``typed_as_shown`` and checks further what the run left behind.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

import yaml

from conftest import REPO

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass
class Block:
    kind: str  # bash | console | python
    text: str
    line: int  # where it starts in its file
    file: str = "README.md"  # relative to the repository

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def readme_blocks(text: str, file: str = "README.md") -> List[Block]:
    return [Block(match.group(1), match.group(2), text.count("\n", 0, match.start()) + 1, file)
            for match in FENCE.finditer(text) if match.group(1) in ("bash", "console", "python")]


def nav_pages(nav) -> Iterator[str]:
    """The pages of mkdocs.yml's nav, in order (entries may nest in sections)."""
    for entry in nav:
        target = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(target, list):
            yield from nav_pages(target)
        else:
            yield target


def documents() -> List[str]:
    """README.md, then the docs pages in the site's order."""
    site = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    return ["README.md", *(f"{site.get('docs_dir', 'docs')}/{page}" for page in nav_pages(site["nav"]))]


def bash_commands(block: Block) -> Iterator[Tuple[str, str]]:
    """(command, reason to skip it or "") for each command of a bash block."""
    pending = ""
    for line in block.text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if not command or command.startswith("#"):
            continue
        comment = command.split(" #", 1)[1].strip() if " #" in command else ""
        yield command, comment[len("needs:"):].strip() if comment.startswith("needs:") else ""


@dataclass
class Step:
    """One thing a reader does: a bash command, a console transcript or a python block."""
    block: Block
    command: str = ""
    needs: str = ""

    @property
    def id(self) -> str:
        return f"{self.block.where} {self.command or self.block.kind}"[:90]

    @property
    def typed(self) -> str:
        """What the reader types: the command without its comment, or a console or python block's whole text."""
        return self.command.split(" #")[0].strip() if self.command else self.block.text.strip()


def readme_steps() -> List[Step]:
    steps = []
    for block in (b for file in documents() for b in readme_blocks((REPO / file).read_text(), file)):
        if block.kind == "bash":
            steps += [Step(block, command, needs) for command, needs in bash_commands(block)]
        else:
            steps.append(Step(block))
    return steps


STEPS = readme_steps()


def assert_in_page_order(page: str, *typed: str) -> None:
    """Each of ``typed`` is still a step of ``page``, in this order: a chain whose later steps read the
    earlier ones' outputs, which a test types whole."""
    steps = [step.typed for step in STEPS if step.block.file == page]
    assert all(step in steps for step in typed), f"{page} no longer shows {[s for s in typed if s not in steps]}"
    order = [steps.index(step) for step in typed]
    assert order == sorted(order), f"{page} no longer shows these steps in this order: {typed}"


@dataclass
class Transcript:
    commands: List[str] = field(default_factory=list)
    outputs: List[List[str]] = field(default_factory=list)


def console_transcript(text: str) -> Transcript:
    """A console block's `$ COMMAND` lines and, for each, the lines shown after it."""
    transcript = Transcript()
    for line in text.splitlines():
        if line.startswith("$ "):
            transcript.commands.append(line[2:])
            transcript.outputs.append([])
        elif transcript.commands and line.strip():
            transcript.outputs[-1].append(line.strip())
    return transcript


def as_pattern(shown: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in shown.split("...")))


def assert_shown_lines_appear(shown: List[str], printed: str, command: str, where: str) -> None:
    lines = iter(printed.splitlines())
    for expected in shown:
        pattern = as_pattern(expected)
        assert any(pattern.search(line) for line in lines), \
            f"{where}: `{command}` did not print, in this order, the line\n  {expected}\nIt printed:\n{printed[-4000:]}"


def console_steps(block: str) -> List[Tuple[str, List[str], Optional[int]]]:
    """(command, the lines it prints as shown, the exit code `echo $?` shows after it or None)."""
    transcript, steps = console_transcript(block), []
    for command, shown in zip(transcript.commands, transcript.outputs):
        if command == "echo $?":
            steps[-1] = (*steps[-1][:2], int(shown[0]))
        else:
            steps.append((command, shown, None))
    return steps


def typed_as_shown(user, block: str, where: str, one_terminal: bool = False) -> List[subprocess.CompletedProcess]:
    """Each command of a console ``block`` typed in the user's copy, printing the lines shown (in order;
    `...` stands for anything) and exiting as `echo $?` shows; their results, in order. With
    ``one_terminal`` stderr goes to stdout, so that lines shown from both streams keep their order."""
    results = []
    for command, shown, exit_code in console_steps(block):
        results.append(user.run(f"{command} 2>&1" if one_terminal else command, timeout=500))
        printed = results[-1].stdout + results[-1].stderr
        assert_shown_lines_appear(shown, printed, command, where)
        assert exit_code in (None, results[-1].returncode), printed[-3000:]
    return results
