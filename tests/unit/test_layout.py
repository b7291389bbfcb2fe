"""The layout as tests: a file's folder says its layer, lower layers never import higher ones, no import
circles, the engine never imports its glue, no ``sys.path`` edits, every module's doctests collected."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "atlas_tracking"
GLUE = ROOT / "integrations"

LAYERS = {
    "receipts": 0, "schema": 0,
    "adapters": 1,
    "artifacts": 2,
    "engine": 3, "decisions": 3, "viz": 3,
    "sinks": 4,
    "cli": 5, "telemetry": 5, "rollouts": 5,
    "gate": 6, "callbacks": 7, "__init__": 8, "compat": 8,
    "testing": 9,
}
"""Each top-level folder (or top-level module) of the package and its rank: a module may import its own
folder and lower ranks, never a higher rank or another folder of the same rank. ``testing`` is the kit the
tests, examples and benchmarks share: it may import anything (integrations included), nothing imports it."""


def module_name(path: Path) -> str:
    if path.is_relative_to(GLUE):
        parts = ("atlas_tracking", "integrations", *path.relative_to(GLUE).with_suffix("").parts)
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    paths = [*PACKAGE.rglob("*.py"), *GLUE.rglob("*.py")]
    return {module_name(p): p for p in paths if "__pycache__" not in p.parts}


def imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports (module level or inside functions), resolved to known modules."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("atlas_tracking"):
                while name not in known and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in known:
                    out.add(name)
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def test_every_package_folder_has_a_layer():
    mods = modules()
    assert "atlas_tracking.engine.measure" in mods and "atlas_tracking.integrations.lightning" in mods, sorted(mods)[:5]
    engine = {layer(m) for m in mods if not m.startswith("atlas_tracking.integrations")}
    assert engine <= set(LAYERS), f"folders without a layer: {sorted(engine - set(LAYERS))}"


def test_lower_layers_never_import_higher_ones_nor_their_siblings():
    bad = []
    for mod, deps in graph().items():
        if mod.startswith("atlas_tracking.integrations"):
            continue
        for dep in deps:
            if dep.startswith("atlas_tracking.integrations"):
                if layer(mod) != "testing":
                    bad.append(f"{mod} imports the glue {dep}")
                continue
            a, b = layer(mod), layer(dep)
            if a != b and LAYERS[b] >= LAYERS[a] and a != "__init__":
                bad.append(f"{mod} ({a}, rank {LAYERS[a]}) imports {dep} ({b}, rank {LAYERS[b]})")
    assert not bad, "\n".join(sorted(bad))


def test_the_glue_never_imports_the_test_kit():
    bad = [f"{mod} imports {dep}" for mod, deps in graph().items() if mod.startswith("atlas_tracking.integrations")
           for dep in deps if layer(dep) == "testing"]
    assert not bad, bad


def test_no_import_circles():
    g = graph()
    # a package's __init__ re-exporting its own modules is not a circle through them
    g = {m: {d for d in deps if not (m != d and m.startswith(d + ".") and g.get(d) and m in g[d])}
         for m, deps in g.items()}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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
                circles.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_sys_path_edits_anywhere():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if any(part in (".venv", "build", "site", "__pycache__") or part.startswith(".") for part in
               path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                    and node.value.id == "sys":
                offenders.append(str(path.relative_to(ROOT)))
                break
    assert not offenders, f"sys.path used in: {offenders}"
