"""`pip install -e .` then `qat-lora demo` (issue 49, item 2): the base dependencies cover the whole demo chain.

CI installs `.[xla,gguf,dev]` once (a second, base-only venv would cost minutes and a large download), so the
base-only install is emulated instead: every distribution that only the extras bring (the extras' requirements
and what they require, minus the base dependencies and what those require, computed from pyproject.toml and the
installed metadata) is made uninstalled in a subprocess -- its modules unimportable and its metadata absent, as
transformers' own `is_..._available` checks look at both -- and the demo runs there, its teacher arriving as a
GGUF file that the real conversion (transformers + gguf + accelerate) turns into a model folder.
"""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import make_model_dir

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _wanted(marker: Marker | None, extras: frozenset[str]) -> bool:
    """Whether a requirement with `marker` applies to this Python when its distribution is asked for with `extras`."""
    return marker is None or any(marker.evaluate({"extra": extra}) for extra in ("", *extras))


def requirement_closure(requirements: list[str]) -> set[str]:
    """The canonical names of `requirements` and, through the installed metadata, of everything they require (a
    distribution that is not installed counts, but brings nothing further)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen or not _wanted(req.marker, frozenset()):
            continue
        seen.add(key)
        try:
            needs = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for need in map(Requirement, needs):
            if _wanted(need.marker, key[1]):
                todo.append(Requirement(str(need).split(";")[0]))  # the marker is settled: drop it
    return {name for name, _ in seen}


# The installer's own tools stay: a venv has pip (and setuptools, whose .pth loads _distutils_hack at start-up, before
# Python 3.12) whatever else is installed.
INSTALLER_TOOLS = {"pip", "setuptools", "wheel"}


def extras_only() -> tuple[set[str], set[str]]:
    """(distributions, top-level modules) that only the extras bring: uninstalled, this is a base-only install."""
    project = _project()
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    dists = requirement_closure(extras) - requirement_closure(project["dependencies"]) - INSTALLER_TOOLS
    # A module several distributions provide (namespace packages) stays importable unless all of them are hidden.
    modules = {module for module, owners in importlib.metadata.packages_distributions().items()
               if all(canonicalize_name(owner) in dists for owner in owners)}
    return dists, modules


# Run by `python -c` before the code under test: the path finder is wrapped so that the hidden distributions look
# uninstalled -- find_spec None (import raises ModuleNotFoundError) and no metadata -- for the whole process.
HIDE_EXTRAS = '''
import importlib.machinery, importlib.metadata, json, re, sys
_hidden = json.loads(sys.argv.pop(1))
_dists, _modules = set(_hidden["dists"]), set(_hidden["modules"])
_early = sorted(m for m in sys.modules if m.partition(".")[0] in _modules)
if _early:
    sys.exit(f"hide-extras: {_early} were imported before the finder (site .pth files?); the check would be void")

class _ExtrasUninstalled:
    """sys.meta_path's PathFinder, blind to the hidden distributions' modules and metadata."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _modules:
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        return (d for d in self.finder.find_distributions(*args, **kwargs)
                if re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "")).lower() not in _dists)

    def invalidate_caches(self):
        self.finder.invalidate_caches()

sys.meta_path[:] = [_ExtrasUninstalled(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


def run_without_extras(code: str, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter in which only the base dependencies are installed, as far as it can tell."""
    dists, modules = extras_only()
    hidden = json.dumps({"dists": sorted(dists), "modules": sorted(modules)})
    return subprocess.run([sys.executable, "-c", HIDE_EXTRAS + code, hidden, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def test_the_extras_only_set_is_what_a_base_install_lacks():
    dists, modules = extras_only()
    # What the extras alone bring (those installed here are hidden by module too) ...
    assert {"torch-xla", "pytest", "datasets", "wandb", "tensorboard", "compressed-tensors", "nbformat"} <= dists
    for dist, module in (("torch-xla", "torch_xla"), ("pytest", "pytest"), ("datasets", "datasets"),
                         ("pandas", "pandas"), ("pyarrow", "pyarrow")):
        if dist in dists and _installed(dist):
            assert module in modules, f"{dist} is installed but {module} would stay importable"
    # ... and never what the demo needs: the GGUF reader, accelerate (transformers' GGUF loading) and the plots.
    base = {"torch", "transformers", "peft", "numpy", "safetensors", "gguf", "accelerate", "matplotlib",
            "tokenizers", "huggingface-hub", "packaging"}
    assert not base & dists, f"the base install must bring {sorted(base & dists)}"


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_hidden_extras_look_uninstalled_to_imports_and_metadata(tmp_path):
    probe = ('import importlib.metadata, importlib.util, json\n'
             'def gone(module, dist):\n'
             '    try:\n'
             '        importlib.metadata.version(dist)\n'
             '        return False\n'
             '    except importlib.metadata.PackageNotFoundError:\n'
             '        pass\n'
             '    try:\n'
             '        __import__(module)\n'
             '        return False\n'
             '    except ModuleNotFoundError:\n'
             '        return importlib.util.find_spec(module) is None\n'
             'print(json.dumps({"pytest": gone("pytest", "pytest"), "torch_xla": gone("torch_xla", "torch-xla"),\n'
             '                  "gguf": importlib.util.find_spec("gguf") is not None}))\n')
    out = run_without_extras(probe, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"pytest": True, "torch_xla": True, "gguf": True}


# The demo with fetch-assets' download replaced by a local GGUF; the conversion that follows it is the real one.
DEMO = '''
import json, sys
from pathlib import Path
import qat_lora.data.assets as assets, qat_lora.data.teachers as teachers
from qat_lora.commands.cli import main

gguf_file, text_dir, eval_text, work = map(Path, sys.argv[1:5])
teachers.MAX_PLAIN_PPL = float("inf")  # the stand-in teacher is random: it speaks no English

def fetch_assets(root=None, *, teacher="", **_):
    folder = work / "assets" / "teacher"
    if not folder.exists():
        teachers.convert_gguf_teacher(gguf_file, folder)
    return assets.Assets(work / "assets", folder, text_dir, eval_text)

assets.fetch_assets = fetch_assets
code = main(["demo", "--work-dir", str(work / "demo"), "--quant", "w2g32", "--seq-len", "32", "--num-samples", "16",
             "--cache-tokens", "6000", "--eval-tokens", "1000", "--max-steps", "3", "--batch-size", "4",
             "--calib-sequences", "16", "--device", "cpu"])
print(json.dumps({"code": code, "loaded": sorted(m for m in ("accelerate", "gguf", "matplotlib") if m in sys.modules)}))
sys.exit(code)
'''


@pytest.mark.slow
def test_demo_runs_on_the_base_install_alone(tmp_path, tokenizer, corpus_dir):
    from qat_lora.commands.demo import PLOT_FILE
    from qat_lora.export.gguf.writer import save_gguf
    from qat_lora.data.models import load_causal_lm
    from qat_lora.quant.fake_quant import quantize_

    # SmolLM2's GGUF stand-in: a tied tiny Llama written as Q8_0 (fetch-assets ships SmolLM2 as Q4_1).
    folder = make_model_dir(tmp_path / "teacher", tokenizer, "llama", init_std=0.25, tie_word_embeddings=True)
    gguf_file = save_gguf(quantize_(load_causal_lm(folder), "q8_0"), tmp_path / "gguf", tokenizer)["file"]
    out = run_without_extras(DEMO, str(gguf_file), str(corpus_dir), str(corpus_dir / "b.txt"), str(tmp_path),
                             cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The GGUF was read (gguf, accelerate) and the picture drawn (matplotlib), all from the base install.
    assert result == {"code": 0, "loaded": ["accelerate", "gguf", "matplotlib"]}
    saved = json.loads((tmp_path / "demo" / "demo.json").read_text())
    assert [r["model"] for r in saved["rows"]] == ["teacher", "ptq", "gptq", "recovered"]
    assert (tmp_path / "demo" / PLOT_FILE).stat().st_size > 0
