"""Imports go one way through the layers (issue #23): a module never imports one of a higher layer.

The layers, lowest first, are ``LAYERS`` below (docs/architecture.md draws them). Every import counts,
the ones inside functions too: a lazy import still ties the two layers together. The upward edges that
remain are listed in ``KNOWN_UPWARD``, each with the files that make it, until the layering work of #23
removes them; the test fails on a new upward edge, and on a listed one that is gone (so the list only
shrinks).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# lowest first; a unit is a subpackage of perfx_compiler, a module at its top level, or schedules
LAYERS: list[set[str]] = [
    {"perfx_compiler", "errors", "artifact_hash", "environment", "progress", "tvmscript_speedups", "tvm_import", "heap",
     "tvm_compiler"},  # no PerfX imports
    {"targets"},  # target descriptions
    {"runtime"},  # the thin runtime: loads and runs artifacts, imports no compiler code
    {"kernels"},  # hand-written TIR generators: (shape, config) -> PrimFunc
    {"formats"},  # weight formats: packing, float64 reference, what their kernels need to know
    {"model"},  # model readers -> ModelDescription (+ its ONNX form)
    {"frontend"},  # ONNX -> Relax
    {"knobs", "schedule_template", "schedules", "schedule"},  # templates: match a PrimFunc, apply a config
    {"passes"},  # Relax passes
    {"narrow_index", "stack_alloca", "gpu_adapt"},  # TIR lowering
    {"tune"},
    {"pipeline", "codegen_parts", "device_export", "package", "compile_report"},  # the compile phases, build, package, report
    {"targets_exec"},  # running every target's code here (emulators, PoCL, lavapipe)
    {"llm", "serve", "bench", "cli"},  # LLM() compiles a model it is given, so it sits above the compiler
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}

KNOWN_UPWARD: set[tuple[str, str]] = set()  # none left: every import goes down the layers


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "schedules":
        return "schedules"
    if parts[0] != "perfx_compiler":
        return None
    return parts[1] if len(parts) > 1 else "perfx_compiler"


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only: nothing is imported at run time)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the files that make the edge."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for top in ("perfx_compiler", "schedules"):
        for f in sorted((REPO / top).rglob("*.py")):
            rel = f.relative_to(REPO)
            module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            package = module if f.name == "__init__.py" else module.rsplit(".", 1)[0]
            src = unit_of(module)
            for node in _runtime_nodes(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    names = [".".join(base + ([node.module] if node.module else []))]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                for name in names:
                    dst = unit_of(name)
                    if src and dst and dst != src:
                        edges[(src, dst)].append(rel.as_posix())
    return edges


def test_every_unit_has_a_layer() -> None:
    units = {u for edge in import_edges() for u in edge}
    assert units <= set(RANK), f"place these in LAYERS: {sorted(units - set(RANK))}"


def test_imports_go_down_the_layers() -> None:
    edges = import_edges()
    upward = {e for e in edges if RANK[e[0]] < RANK[e[1]]}
    new = sorted(f"{a} -> {b} ({', '.join(sorted(set(edges[(a, b)])))})" for a, b in upward - KNOWN_UPWARD)
    assert not new, "imports against the layer order:\n" + "\n".join(new)
    gone = KNOWN_UPWARD - upward
    assert not gone, f"no longer upward, remove from KNOWN_UPWARD: {sorted(gone)}"
