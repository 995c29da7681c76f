"""The package's shape: one subpackage per stage, imports pointing down the flow, no cycles.

The import graph is read from the source (every ``import`` statement, at module
level or inside a function, ``TYPE_CHECKING`` blocks included), so a lazy import
that closes a cycle is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "autofit"

# The flow, lowest first: a module may import only from its own unit or a lower one.
LAYERS = ["errors", "config", "probe", "knobs", "memory", "trial", "search", "emit", "report",
          "result", "preflight", "stages", "api", "compare", "cli", "__main__", ""]  # "" = autofit/__init__.py
TOP_LEVEL_MODULES = {"__init__", "__main__", "api", "compare", "config", "result", "errors"}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The autofit modules ``module`` imports (most specific module of each name)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {_resolve(a.name) for a in node.names if a.name.startswith("autofit")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("autofit"):
                for a in node.names:
                    full = f"{base}.{a.name}"
                    out.add(_resolve(full) if full in MODULES else _resolve(base))
    out.discard(None)
    out.discard(module)
    return out  # type: ignore[return-value]


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_cycle_finder_finds_a_cycle():
    # the checker itself can fail: a two-module and a three-module cycle, and a clean chain
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_imports_point_down_the_flow():
    wrong = []
    for m, deps in GRAPH.items():
        here = LAYERS.index(_unit(m))
        for d in deps:
            there = LAYERS.index(_unit(d))
            if there > here:
                wrong.append(f"{m} -> {d}")
    assert not wrong, "imports against the flow (" + " < ".join(LAYERS[:-1]) + "): " + ", ".join(sorted(wrong))


def test_one_subpackage_per_stage():
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top == TOP_LEVEL_MODULES, f"modules outside the subpackages: {sorted(top - TOP_LEVEL_MODULES)}"
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == {u for u in LAYERS if u and u not in TOP_LEVEL_MODULES}


@pytest.mark.parametrize("init", sorted(str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("__init__.py")))
def test_package_init_only_reexports(init):
    """An ``__init__.py`` holds a docstring, imports, ``__all__`` (and a lazy ``__getattr__``
    re-exporting a name that would import a heavy library, or ``__version__``)."""
    tree = ast.parse((ROOT.parent / init).read_text())
    exported: set[str] = set()
    declared: list[str] = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Import | ast.ImportFrom):
            exported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            declared = list(ast.literal_eval(node.value))
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]:
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            lazy = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)
                    and isinstance(c.value, str) and c.value in declared}
            exported |= lazy
            continue
        pytest.fail(f"{init}: line {node.lineno} is not a re-export ({type(node).__name__})")
    assert declared, f"{init} has no __all__"
    missing = set(declared) - exported
    assert not missing, f"{init}: __all__ names what it does not import: {sorted(missing)}"


def test_public_names_of_the_design_stay():
    import autofit

    for name in ("autofit", "estimate", "measure", "preflight", "TrainConfig", "MemoryEstimate",
                 "FitResult", "TrialResult", "AutofitCallback", "AutofitError",
                 "DoesNotFitError", "PreflightError", "PreflightReport", "is_oom"):
        assert hasattr(autofit, name), name
    assert callable(autofit.autofit) and callable(autofit.estimate) and callable(autofit.measure)


def _function_lines(path: Path) -> dict[str, int]:
    """Lines of each function of ``path`` (nested ones apart), its docstring not counted."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = node.end_lineno - node.lineno + 1
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) \
                    and isinstance(doc.value.value, str):
                n -= doc.end_lineno - doc.lineno + 1
            out[node.name] = n
    return out


def test_one_request_no_options_dict():
    """The request travels typed (``ModelSpec``, ``TuneOptions``): no stage reads an options
    dict again (``opts.get(...)`` / ``opts[...]``) or hands work on through one."""
    wrong = [f"{p.relative_to(ROOT.parent)}:{i}" for p in ROOT.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "opts.get(" in line or "opts[" in line or "opts.pop(" in line]
    assert not wrong, "an options dict is read again: " + ", ".join(wrong)


def test_the_public_pipelines_read_as_steps():
    """``estimate`` and ``autofit`` are a sequence of named steps: each under 100 lines of
    code (their docstrings, the public reference, not counted), and api.py well under the
    1,300 lines it had."""
    lines = _function_lines(ROOT / "api.py")
    assert lines["estimate"] < 100 and lines["autofit"] < 100, lines
    assert len((ROOT / "api.py").read_text().splitlines()) < 1000
