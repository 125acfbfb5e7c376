"""README and docs/: the first page stays short, what is generated is current, every figure README quotes is a
record of docs/results, every link resolves, and README's recipe runs as written (on a tiny stand-in teacher)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_tokenizer, recorded_figures, synthetic_text

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def test_readme_is_a_first_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 120, "README.md is over 120 lines: move the detail to a page under docs/"
    long = [cell[:60] for line in text.splitlines() if line.startswith("|")
            for cell in line.strip().strip("|").split(" | ") if len(cell.split()) > 40]
    assert not long, f"README.md table cells over 40 words: {long}"
    # The two set-up commands: the demo needs the base package only; the tests install the extras they use.
    setup, tests = _blocks(text, "bash")[:2]
    assert setup.strip() == "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/qat-lora demo"
    assert text.index("<!-- test-command -->") < text.index(tests), ".ci/run runs the block after the marker"


def test_generated_docs_are_current():
    # docs/CLI.md from the parser, README's headline table from docs/results/recovery.json (and its picture).
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_every_figure_readme_quotes_is_a_recorded_one():
    figures = re.findall(r"(?<![\w.])(\d+\.\d{2,})(?![\w.])", README.read_text())
    assert figures, "the walker found no figure"
    unbacked = sorted(set(figures) - recorded_figures())
    assert not unbacked, f"README.md quotes figures no docs/results/*.json record holds: {unbacked}"


def test_every_link_in_the_docs_resolves():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"[a-z]+://", target) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to nothing: {broken}"


def _stand_in_assets(home: Path) -> None:
    """~/.cache/qat-lora/assets as fetch-assets leaves it, with a tiny random Llama as SmolLM2 (its context long
    enough for the recipe's 256-token cache and 512-token eval) and synthetic text."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from qat_lora.data import assets

    root = home / ".cache" / "qat-lora" / "assets"
    text = {assets.SHAKESPEARE_TXT: synthetic_text(400, seed=1), assets.GCIDE_TXT: synthetic_text(200, seed=2),
            assets.WIKI_TXT: synthetic_text(200, seed=3), assets.NEWS_TXT: synthetic_text(50, seed=4)}
    for name, body in text.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body)
    tokenizer = make_tokenizer(text[assets.SHAKESPEARE_TXT] + text[assets.GCIDE_TXT])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    teacher = root / assets.TEACHER_DIR
    AutoModelForCausalLM.from_config(config).save_pretrained(teacher)
    tokenizer.save_pretrained(teacher)
    files = sorted(str(p.relative_to(teacher)) for p in teacher.rglob("*") if p.is_file())
    manifest = {"format": assets.FORMAT, "pins": {}, "text": {name: {} for name in text},
                "teachers": {"smollm2-135m": {"folder": assets.TEACHER_DIR, "files": files}}}
    (root / assets.MANIFEST).write_text(json.dumps(manifest))


# The recipe's budgets, shrunk for the tiny stand-in (every command, flag and path stays as README writes it).
SHRINK = {"--tokens 320000": "--tokens 4000", "--batch-size 64": "--batch-size 16",
          "--lora-steps 290": "--lora-steps 4 --calib-sequences 16",
          "--out caches/self": "--out caches/self --holdout-fraction 0.2"}  # 40 documents, not 1,400: hold out 8


@pytest.mark.slow
def test_readme_recipe_runs_as_written(tmp_path):
    recipe = next(b for b in _blocks(README.read_text(), "bash") if "qat-lora recover" in b)
    for budget, small in SHRINK.items():
        assert budget in recipe, f"README's recipe no longer says {budget}: update SHRINK"
        recipe = recipe.replace(budget, small)
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    _stand_in_assets(home)
    env = {k: v for k, v in os.environ.items() if k not in ("QAT_LORA_HOME", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    assert shutil.which("qat-lora", path=env["PATH"]), "qat-lora is not installed beside this Python"
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe], cwd=work, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{"):])  # eval prints its metrics as JSON
    assert result["ppl"] > 1 and result["kd_kl"] >= 0
    assert json.loads((work / "runs" / "w3g64" / "recover.json").read_text())["adapter"].endswith("lora/adapter")
