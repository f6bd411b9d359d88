"""The packages of plait form layers, and an import only points down.

The layers are the table of the section "Import layers" of docs/architecture.md. Every module
under src/plait is read with ``ast`` (nothing is imported), its imports of plait are resolved to
the top-level package or module they reach (``comm``, ``mesh``, ``config``, ...), and then:

* every top-level package or module is in exactly one layer of the table, and the table names
  none that does not exist;
* a module imports only packages of its own layer or of lower ones;
* the packages of one layer import each other without a cycle.

Imports inside functions count (they run when the function does); imports under
``if TYPE_CHECKING:`` do not, since they run nothing (annotations only).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "plait"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SECTION = "## Import layers"

#: Imports that still point up, as (importing module, imported module): none. An entry would be a
#: debt named here until its code moves.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Edge:
    importer: str  # dotted module name, e.g. plait.config.rules.moe
    imported: str  # dotted module name as imported, e.g. plait.moe.model_config

    @property
    def source(self) -> str:
        return top_level(self.importer)

    @property
    def target(self) -> str:
        return top_level(self.imported)


def top_level(module: str) -> str:
    """``plait.config.rules.moe`` -> ``config``; the root package ``plait`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """The plait modules a module imports at run time (module level or inside functions)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.found: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [a.name for a in node.names if a.name.split(".")[0] == "plait"]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            if not self.is_package:
                base = base[:-1]
            base = base[:len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target.split(".")[0] != "plait":
            return
        if target == "plait":  # from plait import config, train
            self.found += [f"plait.{a.name}" for a in node.names]
        else:
            self.found.append(target)


def imports_of(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """The plait modules ``source`` (the text of ``module``) imports at run time."""
    visitor = _Imports(module, is_package)
    visitor.visit(ast.parse(source))
    return visitor.found


def import_edges() -> list[Edge]:
    edges = []
    for path in sorted(SRC.rglob("*.py")):
        module = module_name(path)
        found = imports_of(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py")
        edges += [Edge(module, imported) for imported in found]
    return edges


def top_level_names() -> set[str]:
    """Every top-level package (a directory holding modules) and module of plait."""
    names = {p.stem for p in SRC.glob("*.py") if p.name != "__init__.py"}
    names |= {p.name for p in SRC.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    return names


def documented_layers(text: str) -> list[tuple[int, list[str]]]:
    """``(layer, [package, ...])`` of each row of the section's table, in order."""
    assert SECTION in text, f"docs/architecture.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not cells[0].isdigit():
            continue
        names = [n.rstrip("/").removesuffix(".py") for n in re.findall(r"`([^`]+)`", cells[1])]
        rows.append((int(cells[0]), names))
    return rows


def layer_problems(edges: list[Edge], layers: list[tuple[int, list[str]]],
                   allowed: set[tuple[str, str]]) -> list[str]:
    """One line per import that points up (not in ``allowed``) and per cycle within a layer."""
    layer_of = {name: number for number, names in layers for name in names}
    problems = []
    within: dict[str, dict[str, Edge]] = defaultdict(dict)
    for e in edges:
        a, b = e.source, e.target
        if not a or a == b or a not in layer_of or b not in layer_of:
            continue
        if layer_of[b] > layer_of[a]:
            if (e.importer, e.imported) not in allowed:
                problems.append(f"{e.importer} (layer {layer_of[a]}: {a}) imports {e.imported} "
                                f"(layer {layer_of[b]}: {b}), a higher layer")
        elif layer_of[b] == layer_of[a]:
            within[a].setdefault(b, e)
    for cycle in _cycles(within):
        steps = [within[x][y] for x, y in zip(cycle, cycle[1:] + cycle[:1], strict=True)]
        problems.append(f"layer {layer_of[cycle[0]]} has a cycle {' -> '.join(cycle + cycle[:1])}: "
                        + "; ".join(f"{s.importer} imports {s.imported}" for s in steps))
    return problems


def _cycles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """One cycle (as a list of nodes) per strongly connected component of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_one_cycle(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _one_cycle(graph: dict[str, dict[str, Edge]], component: set[str]) -> list[str]:
    """A cycle through the smallest node of ``component`` (a strongly connected set)."""
    start = min(component)
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph.get(v, {})):
            if w == start:
                return paths[v]
            if w in component and w not in paths:
                paths[w] = paths[v] + [w]
                todo.append(w)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


# ---------------------------------------------------------------------------------------- tests
def test_every_package_is_in_exactly_one_layer():
    layers = documented_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    assert [n for n, _ in layers] == list(range(1, len(layers) + 1)), "layers are numbered 1, 2, ... in order"
    listed = [name for _, names in layers for name in names]
    twice = sorted({n for n in listed if listed.count(n) > 1})
    assert not twice, f"in more than one layer of docs/architecture.md: {twice}"
    missing = sorted(top_level_names() - set(listed))
    assert not missing, f"src/plait/{missing[0]} is in no layer: add it to the table under {SECTION!r}"
    unknown = sorted(set(listed) - top_level_names())
    assert not unknown, f"the table under {SECTION!r} names {unknown}, which src/plait does not have"


def test_imports_point_down_and_layers_have_no_cycle():
    layers = documented_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    problems = layer_problems(import_edges(), layers, ALLOWED_UPWARD)
    assert not problems, "imports against the layers of docs/architecture.md:\n" + "\n".join(problems)


def test_imports_are_resolved_as_python_runs_them():
    source = """
from typing import TYPE_CHECKING
import torch
import plait.comm.collectives
from plait import mesh, nn
from plait.config.schema import Recipe
from . import sibling
from ..data import batch
if TYPE_CHECKING:
    from plait.train.run_state import RunState
else:
    from plait.precision import KNOBS

def run():
    from plait.train.entry import main
"""
    assert imports_of(source, "plait.checkpoint.store") == [
        "plait.comm.collectives", "plait.mesh", "plait.nn", "plait.config.schema", "plait.checkpoint",
        "plait.data", "plait.precision", "plait.train.entry"]
    assert imports_of("from . import format", "plait.checkpoint", is_package=True) == ["plait.checkpoint"]


def test_the_import_graph_is_read():
    """Negative control: the graph holds imports known to exist, and with the layers in reverse
    order the check fails, naming both modules and both layers."""
    edges = import_edges()
    assert Edge("plait.config.rules.moe", "plait.moe.model_config") in edges
    assert any(e.importer == "plait.commands.train" and e.target == "train" for e in edges)  # inside run()
    layers = documented_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    reverse = [(len(layers) + 1 - n, names) for n, names in layers]
    layer_of = {name: n for n, names in reverse for name in names}
    problems = layer_problems(edges, reverse, set())
    assert (f"plait.config.rules.moe (layer {layer_of['config']}: config) imports plait.moe.model_config "
            f"(layer {layer_of['moe']}: moe), a higher layer") in problems


def test_a_cycle_within_a_layer_is_named():
    edges = [Edge("plait.mesh", "plait.comm.collectives"), Edge("plait.comm.p2p", "plait.mesh")]
    problems = layer_problems(edges, [(1, ["comm", "mesh"])], set())
    assert problems == ["layer 1 has a cycle comm -> mesh -> comm: plait.comm.p2p imports plait.mesh; "
                        "plait.mesh imports plait.comm.collectives"]
