"""docs/TPU.md and the notebooks name only flags the CLI has (issue 16): every `--flag` must belong to some
`qat-lora` command, and a flag written after `qat-lora CMD` (in the guide) or passed with a command name (in a
notebook's `qat("CMD", "--flag", ...)` call or `["CMD", "--flag", ...]` list) must belong to that command."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from qat_lora.commands.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "TPU.md"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# A --flag not followed by an underscore: XLA_FLAGS' own --xla_dump_to is not a qat-lora flag.
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*(?![\w])")


def _parsers() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {name: {s for a in p._actions for s in a.option_strings if s.startswith("--")}
            for name, p in sub.choices.items()}


def _cells(path: Path, kind: str = "") -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == (kind or
                                                                                                    c["cell_type"])]


def _notebook_command_flags(source: str) -> list[tuple[str, str]]:
    """(command, flag) for every call or list literal whose first item is a command name string."""
    pairs = []
    for node in ast.walk(ast.parse(source)):
        items = node.args if isinstance(node, ast.Call) else node.elts if isinstance(node, ast.List) else []
        strings = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
        if items and isinstance(items[0], ast.Constant) and strings and strings[0] in _parsers():
            pairs += [(strings[0], s) for s in strings[1:] if s.startswith("--")]
    return pairs


def test_flag_pattern_skips_xla_flags_and_keeps_ours():
    assert FLAG.findall("XLA_FLAGS='--xla_dump_to=/d' qat-lora train --num-chips 4 --resume auto") == [
        "--num-chips", "--resume"]


def _torchrun_flags() -> set[str]:
    """The flags of torchrun itself (the guide's multi-node launch line), from its own parser."""
    from torch.distributed.run import get_args_parser

    return {s for a in get_args_parser()._actions for s in a.option_strings if s.startswith("--")}


# gcloud's own flags in the pod guide's `gcloud compute tpus tpu-vm create / ssh` lines (no gcloud here to ask).
GCLOUD_FLAGS = {"--zone", "--accelerator-type", "--version", "--worker", "--command"}


@pytest.mark.multiprocess
def test_every_guide_flag_exists_in_the_cli():
    known = set().union(*_parsers().values(), _torchrun_flags(), GCLOUD_FLAGS)
    flags = set(FLAG.findall(GUIDE.read_text()))
    assert {"--num-chips", "--xla-cache-dir", "--storage-dtype", "--resume"} <= flags  # the parser sees the guide
    assert not flags - known, f"docs/TPU.md names flag(s) no qat-lora command has: {sorted(flags - known)}"


def test_guide_command_lines_use_their_commands_flags():
    parsers = _parsers()
    # `qat-lora CMD` up to the end of its code span or line (a backslash continues it on the next line).
    command_line = re.compile(rf"qat-lora ({'|'.join(map(re.escape, parsers))})\b((?:[^`\n\\]|\\\n)*)")
    found = command_line.findall(GUIDE.read_text())
    assert any(command == "train" for command, _ in found)
    for command, rest in found:
        wrong = sorted(set(FLAG.findall(rest)) - parsers[command])
        assert not wrong, f"docs/TPU.md: `qat-lora {command}` has no flag(s) {wrong}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_flags_exist_for_their_commands(path):
    parsers = _parsers()
    known = set().union(*parsers.values())
    pairs = [pair for source in _cells(path, "code") for pair in _notebook_command_flags(source)]
    assert {command for command, _ in pairs} >= {"build-cache", "train"}, "the walker sees the notebook's commands"
    wrong = sorted({f"{command} {flag}" for command, flag in pairs if flag not in parsers[command]})
    assert not wrong, f"{path.name}: flag(s) the command does not have: {wrong}"
    stray = sorted(set(FLAG.findall("\n".join(_cells(path)))) - known)  # markdown cells too
    assert not stray, f"{path.name}: flag(s) no qat-lora command has: {stray}"


def test_readme_links_the_guide_and_the_notebooks():
    readme = (ROOT / "README.md").read_text()
    for target in ["docs/TPU.md", *(f"notebooks/{p.name}" for p in NOTEBOOKS)]:
        assert f"({target})" in readme, f"README.md does not link {target}"
