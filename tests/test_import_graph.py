"""No import circle in gpucomm/, and its folders form layers: a module imports only its own layer
and the layers below (:data:`LAYERS`).

The graph is read from the source: an edge for every ``import`` statement (at module level, inside
a function, or under ``if TYPE_CHECKING:``). An import for annotations only names the module as
much as one that runs: a lower module that works with a higher object names the few attributes
it reads as a Protocol instead (gpucomm/roles.py). ``from pkg import name`` is an edge to the
submodule ``pkg.name`` where there is one, else to ``pkg``; the import of a package's
``__init__`` that Python does before any of its submodules is not counted.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "gpucomm"

# gpucomm's layers, bottom first: a folder (every module under it) or a top-level module each.
# docs/architecture.md draws the same picture.
LAYERS: list[tuple[str, ...]] = [
    (
        "gpucomm.errors",
        "gpucomm.config",
        "gpucomm.log",
        "gpucomm.reduce_op",
        "gpucomm.capture",
        "gpucomm.progress",
        "gpucomm.work",
    ),
    ("gpucomm.toolchain",),  # host C code and the build caches
    ("gpucomm.ops",),  # the kernel contract, the program's instruction set, the kernels' launchers
    ("gpucomm.transport",),  # symmetric workspaces: shm, CUDA IPC, the GPU heap
    ("gpucomm.roles",),  # what lower layers read of higher objects, as Protocols
    ("gpucomm.reliability",),  # flight record, hang story, liveness, watchdog
    ("gpucomm.algorithms", "gpucomm.language"),  # programs built from instructions; the device API
    ("gpucomm.workspace",),  # the engine: one path that runs programs on a workspace
    ("gpucomm.gloo",),  # the other paths: gloo, and gloo checked
    ("gpucomm.comm",),  # the communicator: one group of ranks, a call bound to a path
    ("gpucomm.distributed",),  # torch's face: the world, groups, collectives, the backend
    ("gpucomm.fused", "gpucomm.ddp"),  # built on torch's face
    # the package, its commands, and what torch's import calls (installed as _gpucomm_autoload)
    ("gpucomm", "gpucomm.env", "gpucomm.demo", "gpucomm._autoload"),
]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    edges: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_Import(self, node: ast.Import) -> None:
            edges.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            subs = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            edges.update(subs)
            if len(subs) < len(node.names):
                edges.add(base)

    Visitor().visit(ast.parse(path.read_text()))
    return {e for e in edges if e in modules and e != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read(tmp_path: pathlib.Path):
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "gpucomm.workspace.engine" in graph["gpucomm.comm.communicator"]
    assert "gpucomm.transport.shm" in graph["gpucomm.transport.opening"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # An import for annotations only is an edge too.
    lower = tmp_path / "lower.py"
    lower.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpucomm.workspace.engine import Engine\n"
    )
    assert _imports("gpucomm.lower", lower, {**modules, "gpucomm.lower": lower}) == {"gpucomm.workspace.engine"}


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer: its longest listed prefix."""
    found = [
        (len(entry), index)
        for index, entries in enumerate(LAYERS)
        for entry in entries
        if module == entry or (entry != "gpucomm" and module.startswith(entry + "."))
    ]
    if not found:
        raise AssertionError(f"{module} is in no layer of LAYERS: add it to one")
    return max(found)[1]


def test_every_import_goes_down_or_stays_in_its_layer():
    modules = _modules()
    upward = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, path in sorted(modules.items())
        for target in sorted(_imports(name, path, modules))
        if layer_of(target) > layer_of(name)
    ]
    assert upward == []


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("gpucomm.workspace.engine") > layer_of("gpucomm.algorithms.allreduce")
    assert layer_of("gpucomm.transport.shm") < layer_of("gpucomm.reliability.flight")
    assert layer_of("gpucomm") == len(LAYERS) - 1


def test_at_most_twelve_modules_at_the_top_and_none_over_500_lines():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 12, top
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == []
