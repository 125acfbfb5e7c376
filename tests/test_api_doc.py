"""docs/API.md runs as written (issue 49, item 4): its ```python blocks, in order, in one namespace, on a tiny model.

How the page maps to the test, so that it stays readable and copyable:
- Inputs: the page's first block names the demo's assets (`~/.cache/qat-lora/assets`, the teacher
  `smollm2-135m`); the test points HOME at a tmp folder holding stand-ins of them (a tiny random Llama under
  SmolLM2's folder name, synthetic text; tests/test_docs.py's `_stand_in_assets`) and runs from a tmp folder, so
  the relative `runs/api/...` paths the page prints are the same here.
- Budgets: SHRINK replaces the page's budgets with tiny ones; each must still be on the page.
- Output: a ```text block right after a ```python block is what that block prints, compared as a doctest is
  (`...` matches anything, including whole lines; whitespace runs are equal). A block with none may print anything.
Nothing is mocked: every call builds, quantises, trains, evaluates and exports for real.
"""
from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

from tests.test_docs import _stand_in_assets

API_MD = Path(__file__).resolve().parents[1] / "docs" / "API.md"
# (a tenth held out: at 8 k tokens the page's 2 % would leave one sequence, and build_cache would warn about it)
SHRINK = {"max_tokens=320_000": "max_tokens=8_000, holdout_fraction=0.1", "calib_sequences=128": "calib_sequences=16",
          "lora_steps=290": "lora_steps=4", "max_tokens=8192": "max_tokens=2048"}
CHECKER, OPTIONS = doctest.OutputChecker(), doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def api_examples(text: str) -> list[tuple[str, str | None]]:
    """[(python code, the text block right after it or None)] in page order."""
    blocks = re.findall(r"^```(python|text)\n(.*?)^```", text, re.M | re.S)
    examples: list[tuple[str, str | None]] = []
    for kind, body in blocks:
        if kind == "python":
            examples.append((body, None))
        elif examples and examples[-1][1] is None:
            examples[-1] = (examples[-1][0], body)
    return examples


@pytest.mark.slow
def test_api_page_runs_as_written(tmp_path, monkeypatch, capsys):
    page = API_MD.read_text()
    for budget, small in SHRINK.items():
        assert budget in page, f"docs/API.md no longer says {budget}: update SHRINK"
        page = page.replace(budget, small)
    for var in ("QAT_LORA_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _stand_in_assets(tmp_path / "home")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    examples = api_examples(page)
    assert len(examples) >= 6, "the inputs, the five calls and the model-level block"
    namespace: dict = {}
    for number, (code, expected) in enumerate(examples, 1):
        capsys.readouterr()
        exec(compile(code, f"docs/API.md block {number}", "exec"), namespace)
        printed = capsys.readouterr().out
        if expected is not None and not CHECKER.check_output(expected, printed, OPTIONS):
            example = doctest.Example(code, expected)
            pytest.fail(f"docs/API.md block {number}:\n" + CHECKER.output_difference(example, printed, OPTIONS))


def test_configs_take_paths_as_python_gives_them(tmp_path):
    # A Path in a str field is its string, one path in a list field a list of one: both as the flags hold them, so
    # the configs' JSON records and their comparisons on resume see strings.
    from qat_lora import CacheBuildConfig, EvalConfig

    cfg = CacheBuildConfig(teacher=tmp_path / "teacher", data=tmp_path / "text", out=tmp_path / "cache")
    assert (cfg.teacher, cfg.data, cfg.out) == (str(tmp_path / "teacher"), [str(tmp_path / "text")],
                                                str(tmp_path / "cache"))
    assert CacheBuildConfig(teacher="t", data=["a", Path("b")]).data == ["a", "b"]
    with pytest.raises(ValueError, match=r"^--text .*missing.txt: no such file or folder$"):
        EvalConfig(model="m", text=tmp_path / "missing.txt")
