"""The package layering of the README's architecture section, checked on the source.

Every `import magis.X` (at module level or inside a function) must point down the layer order
or stay inside its own package; the module import graph has no cycles; no module is over
500 lines except the declarative tables.
"""

from __future__ import annotations

import ast
from pathlib import Path

import rustworkx as rx

ROOT = Path(__file__).resolve().parents[1] / "magis"

# Lowest first; a package may import only packages of a lower layer (and itself). Keep in step
# with the README's "Architecture" section.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("ir",),
    ("capture", "cost"),
    ("sim",),
    ("schedule", "layout"),
    ("analyze", "backend"),
    ("rules",),
    ("search",),
    ("baselines",),
    ("explain",),
    ("plan",),
    ("report",),
    ("commands",),
    ("train",),
    ("bench",),
    ("cli",),
    ("__init__", "__main__"),
)
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

# Tables, not logic: one entry per op or per dimension rule.
DECLARATIVE = {"ir/ops.py", "ir/dims.py"}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` reads (relative imports resolved)."""
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return base


def _imports(path: Path, module: str, is_package: bool) -> set[str]:
    """Every magis module `path` imports, resolved (relative imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "magis")
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, is_package)
            if base.split(".")[0] != "magis":
                continue
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph():
    mods = _modules()
    edges = {}
    for name, path in mods.items():
        targets = {t for t in _imports(path, name, path.name == "__init__.py") if t in mods}
        edges[name] = targets - {name}
    return mods, edges


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()}
    assert packages <= set(RANK), f"add {sorted(packages - set(RANK))} to LAYERS and the README"


def test_imports_point_down_the_layers():
    _, edges = _graph()
    upward = sorted(
        f"{src} imports {dst}"
        for src, targets in edges.items()
        for dst in targets
        if _package(src) != _package(dst) and RANK[_package(dst)] >= RANK[_package(src)]
    )
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycles_between_modules():
    mods, edges = _graph()
    g = rx.PyDiGraph()
    index = {m: g.add_node(m) for m in mods}
    for src, targets in edges.items():
        for dst in targets:
            # `from magis.x import y` inside package x reads x's __init__, which imports its
            # own submodules: that edge is the package's re-export, not a cycle of logic.
            if dst == src.rsplit(".", 1)[0]:
                continue
            g.add_edge(index[src], index[dst], None)
    cycles = [[g[n] for n in c] for c in rx.simple_cycles(g)]
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_no_module_over_500_lines_except_tables():
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
        and str(p.relative_to(ROOT)) not in DECLARATIVE
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _private(name: str) -> bool:
    """One leading underscore: a module's own name. Dunder names are Python's, not private."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_definitions(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, assigned names and attributes
    (`self._memo = ...`), and names it imports under a private alias."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
    return {n for n in names if _private(n)}


def _private_uses(name: str, path: Path, tree: ast.AST, others: set[str]) -> list[str]:
    """Where module `name` reaches another magis module's private name: an import of it, or
    an attribute access of a private name that this module never defines and another magis
    module does. (The AST has no types; a name another library defines, such as torch's
    `_schema`, is none of magis's business.)"""
    own = _private_definitions(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _from_base(node, name, path.name == "__init__.py")
            if base.split(".")[0] == "magis" and base != name:
                found += [
                    f"{name}:{node.lineno} imports {base}.{a.name}"
                    for a in node.names
                    if _private(a.name)
                ]
        elif _reaches_private(node, own, others):
            found.append(f"{name}:{node.lineno} reads {ast.unparse(node)}")
    return found


def _reaches_private(node: ast.AST, own: set[str], others: set[str]) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and _private(node.attr)
        and node.attr not in own
        and node.attr in others
    )


def test_no_module_uses_another_modules_private_names():
    """A leading underscore says "this module's own": a module that needs another's private
    name asks for it to be made public (with a docstring) or for the code to move. Objects
    calling each other's private methods is what STYLE.md's habits to avoid name first."""
    mods = _modules()
    trees = {name: ast.parse(path.read_text()) for name, path in mods.items()}
    defined = {name: _private_definitions(tree) for name, tree in trees.items()}
    found = []
    for name, tree in sorted(trees.items()):
        others = set().union(*(d for m, d in defined.items() if m != name))
        found += _private_uses(name, mods[name], tree, others)
    assert not found, "private names used from another module:\n" + "\n".join(found)
