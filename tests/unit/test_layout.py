"""The package's shape, checked from its source: layers that only import downwards, no import circle, no mixin in
the Lightning adapter, short functions, and an ``import strategies`` that costs no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "strategies"
MAX_LINES = 40  # DESIGN.md: functions under ~40 lines


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path, name: str | None = None, modules: set[str] | frozenset = frozenset()) -> set[str]:
    """Every module ``path`` (module ``name``) imports, at any depth of its code, but not under ``if
    TYPE_CHECKING``. ``from package import name`` imports the submodule where ``modules`` has one, else the
    package."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this file is in
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))
MODULES = {_module_name(p): p for p in SOURCES}


def test_the_library_imports_neither_demos_nor_tests_nor_the_dashboard():
    wrong = {name: sorted(i for i in _imports(path) if i.split(".")[0] in ("demos", "tests", "dashboard"))
             for name, path in MODULES.items()}
    assert not {k: v for k, v in wrong.items() if v}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports that comes back to where it started, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_circle_inside_the_package():
    known = set(MODULES)
    graph = {name: {i for i in _imports(path, name, known) if i in MODULES and i != name}
             for name, path in MODULES.items()}
    assert (found := find_cycle(graph)) is None, " -> ".join(found)


def test_the_check_finds_a_circle(tmp_path):
    # Two modules that import each other, one of them inside a function, are a circle.
    (tmp_path / "a.py").write_text("import c\nimport b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("import os\n")
    graph = {name: {i for i in _imports(tmp_path / f"{name}.py", name, set("abc")) if i in "abc"} for name in "abc"}
    assert find_cycle(graph) == ["a", "b", "a"]


def test_the_lightning_adapter_has_no_mixin():
    from lightning.pytorch.strategies import ParallelStrategy

    from strategies.lightning.strategy import PlanStrategy

    assert PlanStrategy.__bases__ == (ParallelStrategy,)
    for path in sorted((PACKAGE / "lightning").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert "mixin" not in node.name.lower(), f"{path.name}: {node.name}"


def test_no_engine_type_checks_in_the_glue():
    for path in sorted((PACKAGE / "lightning").glob("*.py")):
        text = path.read_text()
        for needle in ("isinstance(self.grad_sync", "hasattr(self.grad_sync", "ZeroGradSync", "Zero3GradSync",
                       "BucketedDataParallel)", "TensorParallel)", "PipelineParallel)"):
            assert needle not in text, f"{path.name} asks which engine it holds: {needle}"


@pytest.mark.parametrize("folder", ["strategies", "dashboard", "demos", "scripts"])
def test_no_function_outside_the_tests_is_longer_than_40_lines(folder):
    long = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if node.end_lineno - start + 1 > MAX_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - start + 1} lines)")
    assert not long


def test_import_strategies_costs_no_torch_and_registers_once_lightning_loads():
    # The dashboard and `stratpack plan` import the pack without torch; a Trainer built afterwards still finds
    # every plan name, whichever of the two was imported first.
    code = ("import sys, strategies; assert 'torch' not in sys.modules, 'torch imported'; "
            "import lightning as L; "
            "t = L.Trainer(strategy='zero3_tp2', accelerator='cpu', devices=4, logger=False); "
            "print(type(t.strategy).__name__, t.strategy.resolved_plan)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["PlanStrategy", "zero3_dp2_tp2"]


def test_the_flat_layouts_module_names_still_resolve_with_a_warning():
    import strategies

    with pytest.warns(DeprecationWarning, match="strategies.monitor is now strategies.measure.monitor"):
        assert strategies.monitor.StrategyMonitor is strategies.StrategyMonitor
    with pytest.warns(DeprecationWarning, match="strategies.Schedule is now strategies.PipelineSchedule"):
        assert strategies.Schedule is strategies.PipelineSchedule
    assert strategies.pipeline.schedules.gpipe(2, 2)  # sub-packages as attributes, as before
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        strategies.nothing
