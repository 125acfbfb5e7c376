"""The package's shape (docs/ARCHITECTURE.md): subpackages by stage whose imports point down the stages, no
import cycle, small modules and folders, only the CLI reads argv, the plot command loads no trainer, and the
docs/GUIDE.md documents every flag."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qat_lora"
MAX_MODULE_LINES = 400
MAX_FOLDER_MODULES = 12  # modules other than __init__.py

# The stages, bottom to top: a module may import its own stage and those below it, never one above.
STAGES = ("runtime", "data", "cache", "quant", "train", "export", "commands")


def _name(path: Path) -> str:
    """qat_lora/quant/gptq.py -> 'quant.gptq'; a package's __init__.py -> the package's name."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in PACKAGE.rglob("*.py")}


def _module_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every qat_lora module that `path` imports, at any depth (lazy imports inside functions count too)."""
    here = _name(path).split(".") if path.stem == "__init__" else _name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1] if node.level > 1 else here
                prefix = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("qat_lora"):
                prefix = node.module.removeprefix("qat_lora").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from pkg import module` names a module; otherwise the prefix is one
                joined = f"{prefix}.{alias.name}" if prefix else alias.name
                targets.append(joined if joined in modules else prefix)
        elif isinstance(node, ast.Import):
            targets = [a.name.removeprefix("qat_lora.") for a in node.names if a.name.startswith("qat_lora.")]
        found.update(t for t in targets if t in modules)
    return found - {_name(path), ""}


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _module_imports(path, modules) for name, path in modules.items() if name}


def _stage(module: str) -> int | None:
    top = module.split(".")[0]
    return STAGES.index(top) if top in STAGES else None


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else [node, dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_every_module_is_in_a_stage():
    stray = [name for name in _modules() if name and name != "__main__" and _stage(name) is None]
    assert not stray, f"modules outside the stage subpackages {STAGES}: {stray}"


def test_no_import_cycle_between_modules():
    graph = _import_graph()
    assert graph["train.trainer"] >= {"train.config", "train.student", "train.loss", "cache.reader"}  # real edges
    # A subpackage's __init__ re-exports its modules: importing it is importing them, so it is no cycle member.
    graph = {name: {d for d in deps if name not in STAGES or not d.startswith(name + ".")} for name, deps in
             graph.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_point_down_the_stages():
    arrows_up = []
    for module, deps in _import_graph().items():
        stage = _stage(module)
        if stage is None:  # qat_lora/__init__ (the public API) and __main__ sit above every stage
            continue
        arrows_up += [f"{module} -> {dep}" for dep in sorted(deps) if (_stage(dep) or 0) > stage]
    assert not arrows_up, f"imports that point up the stages {STAGES}: {arrows_up}"


def test_stage_walker_sees_an_arrow_up(tmp_path):
    # The walker resolves relative and absolute forms alike, so an arrow up cannot hide behind a spelling.
    modules = {"quant.gptq": Path("x"), "train.student": Path("y"), "train": Path("z")}
    source = tmp_path / "gptq.py"
    source.write_text("from ..train import student\nfrom qat_lora.train.student import x\n")
    fake_root = tmp_path / "qat_lora" / "quant"
    fake_root.mkdir(parents=True)
    (fake_root / "gptq.py").write_text(source.read_text())
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "qat_lora"
    try:
        assert _module_imports(fake_root / "gptq.py", modules) == {"train.student"}
    finally:
        PACKAGE = saved


@pytest.mark.parametrize("stage", STAGES)
def test_stage_says_what_it_owns_and_may_import(stage):
    doc = ast.get_docstring(ast.parse((PACKAGE / stage / "__init__.py").read_text())) or ""
    assert len(doc.split()) >= 15, f"qat_lora/{stage}/__init__.py: say what the stage owns and what it may import"
    assert "import" in doc, f"qat_lora/{stage}/__init__.py: name the stages it may import"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)}: {lines} lines (split it: one concept per module)"


@pytest.mark.parametrize("folder", sorted({p.parent for p in PACKAGE.rglob("*.py")}), ids=lambda p: p.name)
def test_folder_is_small(folder):
    modules = [p for p in folder.glob("*.py") if p.stem != "__init__"]
    assert len(modules) <= MAX_FOLDER_MODULES, f"{folder.relative_to(ROOT)}: {len(modules)} modules"


def test_only_the_cli_reads_argv():
    for path in PACKAGE.rglob("*.py"):
        if _name(path) == "commands.cli":
            continue
        text = path.read_text()
        assert "sys.argv" not in text and "parse_args" not in text and "parse_known_args" not in text, path.name


def test_plot_command_loads_neither_trainer_nor_torch_xla(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-3} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    probe = ("import sys, json; from qat_lora.commands.cli import main; code = main(['plot', sys.argv[1]]); "
             "print(json.dumps({'code': code, 'loaded': sorted(m for m in sys.modules "
             "if m.startswith(('torch_xla', 'qat_lora.train.trainer', 'qat_lora.train.student', 'peft')))}))")
    out = subprocess.run([sys.executable, "-c", probe, str(run)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "loaded": []}
    assert (run / "curves.png").stat().st_size > 0


def test_public_api_is_importable_and_lazy():
    # Every public name resolves to where its stage defines it; importing the package loads none of them.
    probe = ("import sys, json, qat_lora; before = sorted(m for m in sys.modules if m.startswith(('qat_lora.', "
             "'torch_xla', 'peft'))); names = {n: getattr(qat_lora, n).__module__ if hasattr(getattr(qat_lora, n), "
             "'__module__') else None for n in qat_lora.__all__ if n != '__version__'}; "
             "print(json.dumps({'before': before, 'names': names}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["before"] == []
    from qat_lora import _PUBLIC

    for name, module in result["names"].items():
        assert module in (None, _PUBLIC[name]), f"qat_lora.{name} comes from {module}, not {_PUBLIC[name]}"
    readme = (ROOT / "README.md").read_text()
    for line in re.findall(r"^from qat_lora(?:\.[\w.]+)? import .+$", readme, re.M):  # README's Python block runs
        subprocess.run([sys.executable, "-c", line], check=True, cwd=ROOT)


def test_every_dotted_name_the_docs_cite_resolves():
    # README and docs/ cite code as qat_lora.stage.module.name: each must import, so a move cannot leave them stale.
    import importlib

    cited = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        cited.update(re.findall(r"\bqat_lora(?:\.[A-Za-z_]\w*){2,}", doc.read_text()))
    assert cited, "the walker found no citation"
    for dotted in sorted(cited):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"{dotted}: {'.'.join(parts[:cut])} has no {attr}"
                obj = getattr(obj, attr)
            break


def _flags(command: str) -> set[str]:
    from qat_lora.commands.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


@pytest.mark.parametrize("command", ["generate-data", "build-cache", "quantize", "recover", "train", "eval", "export",
                                     "demo"])
def test_the_guide_documents_every_flag(command):
    # docs/CLI.md lists every flag by construction (docs/generate.py); the guide says what each is for.
    guide = (ROOT / "docs" / "GUIDE.md").read_text()
    documented = set(re.findall(r"--[a-z0-9][a-z0-9-]*", guide))
    missing = sorted(_flags(command) - documented)
    assert not missing, f"docs/GUIDE.md does not mention {command} flag(s) {missing}"
