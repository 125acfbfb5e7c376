"""The package's shape (docs/ARCHITECTURE.md): dependencies point one way, modules stay small, only the CLI
reads argv, the plot command loads no trainer, and the README documents every flag."""
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
MAX_MODULE_LINES = 500


def _module_imports(path: Path) -> set[str]:
    """Every qat_lora module that `path` imports, at any depth (lazy imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .x import y / from . import x, y
                found.update([node.module] if node.module else [a.name for a in node.names])
            elif node.level == 0 and (node.module or "").startswith("qat_lora"):
                rest = node.module.removeprefix("qat_lora").lstrip(".")
                found.update([rest.split(".")[0]] if rest else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("qat_lora."))
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {m for m in found if m in modules and m != path.stem}


def _import_graph() -> dict[str, set[str]]:
    return {p.stem: _module_imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


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


def test_no_import_cycle_between_modules():
    graph = _import_graph()
    assert graph["train"] >= {"config", "student", "loss", "cache"}  # the walker sees real edges
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_components_never_import_recipes():
    # Recipes (commands) sit on top: no component may import one, so each recipe stays a thin script.
    recipes = {"cli", "train", "evaluate", "export", "demo", "launch", "cache_build", "plot", "ptq", "recover",
               "self_data", "generate"}
    graph = _import_graph()
    for module, deps in graph.items():
        if module in recipes:
            continue
        assert not deps & recipes, f"component {module} imports recipe(s) {sorted(deps & recipes)}"


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_module_is_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.name}: {lines} lines (split it: one concept per module)"


def test_only_the_cli_reads_argv():
    for path in PACKAGE.glob("*.py"):
        if path.stem == "cli":
            continue
        text = path.read_text()
        assert "sys.argv" not in text and "parse_args" not in text and "parse_known_args" not in text, path.name


def test_plot_command_loads_neither_trainer_nor_torch_xla(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-3} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    probe = ("import sys, json; from qat_lora.cli import main; code = main(['plot', sys.argv[1]]); "
             "print(json.dumps({'code': code, 'loaded': sorted(m for m in sys.modules "
             "if m.startswith(('torch_xla', 'qat_lora.train', 'qat_lora.student', 'peft')))}))")
    out = subprocess.run([sys.executable, "-c", probe, str(run)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "loaded": []}
    assert (run / "curves.png").stat().st_size > 0


def _flags(command: str) -> set[str]:
    from qat_lora.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


@pytest.mark.parametrize("command", ["generate-data", "build-cache", "quantize", "recover", "train", "eval", "export",
                                     "demo"])
def test_readme_documents_every_flag(command):
    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"--[a-z0-9][a-z0-9-]*", readme))
    missing = sorted(_flags(command) - documented)
    assert not missing, f"README.md does not mention {command} flag(s) {missing}"
