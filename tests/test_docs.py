"""Every command in README.md and docs/*.md is run or parsed; the docs site builds.

Each ```bash block is split into commands (backslash continuations joined, a quoted
argument may span lines, ``#`` comments dropped, ``&&`` / ``||`` / ``;`` split):

- every ``autofit ...`` command must parse with the real parser
  (``autofit.cli.main.build_parser``), so a renamed or removed option breaks a test;
- a block is run (in a temporary folder, its commands in order) unless the line
  before it is ``<!-- not run: REASON -->``. Estimates of bundled tiny models run in
  the fast suite; every other runnable command runs under ``-m slow``;
- a runnable block holds only ``autofit`` commands and ``pip install`` (skipped: the
  test runs in the installed environment);
- every ``examples/...`` path a command names exists;
- ``mkdocs build --strict`` passes (skipped when mkdocs is not installed).

Writing docs: see docs/development.md, "Writing docs".
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->\s*$")
_SEPARATORS = {"&&", "||", ";"}
# bundled models small enough to estimate in the fast suite
_TINY = {"tiny-llama", "tiny-gpt2", "tiny-bert", "tiny-t5", "examples/tiny-model"}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # the line of its ```bash fence
    commands: tuple[tuple[str, ...], ...]
    not_run: str | None  # the reason given in <!-- not run: ... -->

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def split_commands(text: str) -> list[tuple[str, ...]]:
    """The commands of a bash block, each as its argv."""
    text = text.replace("\\\n", " ")
    commands: list[tuple[str, ...]] = []
    pending = ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            tokens = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the argument goes on on the next line
            continue
        pending = ""
        current: list[str] = []
        for token in tokens:
            if token in _SEPARATORS:
                commands.append(tuple(current))
                current = []
            else:
                current.append(token)
        commands.append(tuple(current))
    assert not pending, f"unclosed quote in: {pending!r}"
    return [c for c in commands if c]


def _blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _NOT_RUN.search(before)
        blocks.append(Block(page=str(path.relative_to(ROOT)),
                            line=text.count("\n", 0, match.start()) + 1,
                            commands=tuple(split_commands(match.group(1))),
                            not_run=marker.group(1) if marker else None))
    return blocks


BLOCKS = [b for page in PAGES for b in _blocks(page)]
AUTOFIT = [(b, c) for b in BLOCKS for c in b.commands if c[0] == "autofit"]


def _is_fast(command: tuple[str, ...]) -> bool:
    """An analytic one-step estimate of a bundled tiny model: seconds, no trial (a
    whole-run estimate, ``--dataset``, simulates the run's steps: slow)."""
    return (len(command) > 2 and command[1] == "estimate" and command[2] in _TINY
            and "simulate" not in command and "--dataset" not in command)


def _is_skipped(command: tuple[str, ...]) -> bool:
    return command[:2] == ("pip", "install")


def test_the_docs_have_commands():
    assert len(AUTOFIT) >= 30
    assert any(b.not_run is None for b in BLOCKS)
    assert any(_is_fast(c) for _, c in AUTOFIT)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the reference goes in docs/"


@pytest.mark.parametrize("block, command", AUTOFIT,
                         ids=[f"{b.where}:{c[1]}" for b, c in AUTOFIT])
def test_autofit_command_parses(block, command):
    from autofit.cli.main import build_parser

    try:
        build_parser().parse_args(list(command[1:]))
    except SystemExit as e:
        pytest.fail(f"{block.where}: `{shlex.join(command)}` does not parse (exit {e.code})")


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_named_example_files_exist(block):
    for command in block.commands:
        for arg in command:
            if arg.startswith("examples/"):
                assert (ROOT / arg).exists(), f"{block.where}: {arg} does not exist"


RUNNABLE = [b for b in BLOCKS if b.not_run is None]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_blocks_hold_only_autofit(block):
    others = [shlex.join(c) for c in block.commands if c[0] != "autofit" and not _is_skipped(c)]
    assert not others, (f"{block.where}: {others} cannot run in a test; mark the block "
                        "<!-- not run: REASON --> or keep it to autofit commands")


def test_not_run_needs_a_reason():
    for block in BLOCKS:
        assert block.not_run is None or block.not_run.strip(), block.where


def _workdir(tmp_path: Path) -> Path:
    """A folder to run docs commands in: the repository's examples beside them."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return tmp_path


def _first(items, key):
    """The items, each key once (a command shown on two pages is run once)."""
    seen, kept = set(), []
    for item in items:
        if key(item) not in seen:
            seen.add(key(item))
            kept.append(item)
    return kept


FAST = _first([(b, c) for b in RUNNABLE for c in b.commands if c[0] == "autofit" and _is_fast(c)],
              key=lambda bc: bc[1])


@pytest.mark.parametrize("block, command", FAST, ids=[f"{b.where}:{' '.join(c[1:3])}" for b, c in FAST])
def test_fast_command_runs(block, command, tmp_path, monkeypatch, capsys):
    from autofit.cli.main import main

    monkeypatch.chdir(_workdir(tmp_path))
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    code = main(list(command[1:]))
    out = capsys.readouterr()
    assert code == 0, f"{block.where}: `{shlex.join(command)}` exit {code}: {out.err[-2000:]}"


def _slow_commands(block: Block) -> tuple[tuple[str, ...], ...]:
    return tuple(c for c in block.commands
                 if c[0] == "autofit" and not _is_fast(c) and not _is_skipped(c))


SLOW = _first([b for b in RUNNABLE if _slow_commands(b)], key=_slow_commands)


@pytest.mark.slow
@pytest.mark.parametrize("block", SLOW, ids=[b.where for b in SLOW])
def test_slow_block_runs(block, tmp_path):
    cwd = _workdir(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOFIT_CACHE_DIR": str(tmp_path / "cache")}
    for command in _slow_commands(block):  # pip install: done; fast ones: test_fast_command_runs
        done = subprocess.run([sys.executable, "-m", "autofit", *command[1:]], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=3600)
        assert done.returncode == 0, (f"{block.where}: `{shlex.join(command)}` exit "
                                      f"{done.returncode}: {done.stderr[-2000:]}")


def test_split_commands():
    text = ("pip install -e \".[bnb]\" && autofit tune m --dataset d \\\n    -o t.yaml  # c\n"
            "autofit estimate m --peft-config '{\"a\": 1,\n   \"b\": 2}' --json\n")
    assert split_commands(text) == [
        ("pip", "install", "-e", ".[bnb]"),
        ("autofit", "tune", "m", "--dataset", "d", "-o", "t.yaml"),
        ("autofit", "estimate", "m", "--peft-config", '{"a": 1,\n   "b": 2}', "--json"),
    ]


def test_a_renamed_option_fails_to_parse():
    from autofit.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["estimate", "tiny-llama", "--batch-size", "4", "--no-such-option"])


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def _slugs(path: Path) -> set[str]:
    from markdown.extensions.toc import slugify  # what mkdocs' toc uses

    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_readme_links_resolve():
    pytest.importorskip("markdown")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README.md links to {path}, which does not exist"
        if anchor:
            assert anchor in _slugs(ROOT / path), f"README.md links to {target}: no such heading"
