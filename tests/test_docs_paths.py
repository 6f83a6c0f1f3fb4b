"""Every file, test and module that docs/*.md and README.md name exists in the repository.

A path written in the docs (``gpucomm/workspace/engine.py``, ``kernels/triton/program.py``,
``bench/host_time.py``, ``tests/ops/test_launcher.py``, a glob such as ``gpucomm/ops/*_ops.py``)
must name a file or folder of the repository, and ``tests/x.py::test_name`` a test defined in that
file; a dotted module name (``gpucomm.workspace.channels.granule``) must name a module, and the name
after it one that module defines. So a module or test that moves or is renamed takes its mentions
in the docs with it. docs/architecture.md's table of layers draws the layers that
tests/test_import_graph.py checks (``LAYERS``), in its order, and each file it names lies in its
row's folder. docs/results/ holds records of past runs, written with the paths of their day: it
is not read.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib
import re

_REPO = pathlib.Path(__file__).resolve().parent.parent
# The folders that ship as gpucomm's private packages (pyproject.toml's package-dir).
_PACKAGE_DIRS = {"_kernels": "kernels", "_bench": "bench"}

# A repository path: one of the four roots, then path characters, ending on a name character (a
# sentence's full stop or a trailing comma is not part of it). gpucomm/ paths count where they
# end in ``.py`` or ``/``: elsewhere ``gpucomm/<token>/`` is a store key and ``gpucomm/nccl`` a
# column of a benchmark table.
_PATH = re.compile(r"(?<![\w./<-])((?:gpucomm|kernels|bench|tests)/[\w./*-]*[\w*/])(::\w+)?")
_MODULE = re.compile(r"(?<![\w./])gpucomm(?:\.\w+)+")


def _documents() -> list[pathlib.Path]:
    return [*sorted((_REPO / "docs").glob("*.md")), _REPO / "README.md"]


def _mentions(pattern: re.Pattern[str]) -> list[tuple[str, re.Match[str]]]:
    """Each match of ``pattern`` in the docs, with the ``file:line`` it is on."""
    found = []
    for doc in _documents():
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            found += [(f"{doc.relative_to(_REPO)}:{number}", m) for m in pattern.finditer(line)]
    return found


def _paths() -> list[tuple[str, str, str | None]]:
    """(where, path, test name or None) for every repository path the docs write."""
    found = []
    for where, m in _mentions(_PATH):
        path, test = m.group(1), m.group(2)
        if path.startswith("gpucomm/") and not path.endswith((".py", "/")):
            continue
        found.append((where, path, test[2:] if test else None))
    return found


def _exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return any(_REPO.glob(path))
    return (_REPO / path).exists()


def _module_file(parts: list[str]) -> pathlib.Path | None:
    """The source of module ``gpucomm.<parts>`` (kernels/ and bench/ as gpucomm's private packages)."""
    if parts and parts[0] in _PACKAGE_DIRS:
        base = _REPO / _PACKAGE_DIRS[parts[0]] / "/".join(parts[1:])
    else:
        base = _REPO / "gpucomm" / "/".join(parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if parts and candidate.is_file():
            return candidate
    return None


@functools.cache
def _defined(source: pathlib.Path) -> frozenset[str] | None:
    """The names a module defines at its top level; None where some cannot be read from its source
    (a ``from x import *``, or a module ``__getattr__``)."""
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return None if "__getattr__" in names else frozenset(names)


def _module_problem(name: str) -> str | None:
    """Why the dotted name ``name`` (``gpucomm.a.b.attr``) names nothing, or None."""
    parts = name.split(".")[1:]
    for cut in range(len(parts), 0, -1):
        source = _module_file(parts[:cut])
        if source is None:
            continue
        rest = parts[cut:]
        names = _defined(source)
        if rest and names is not None and rest[0] not in names:
            return f"{'.'.join(['gpucomm', *parts[:cut]])} defines no {rest[0]!r}"
        return None
    import gpucomm

    if not hasattr(gpucomm, parts[0]):
        return f"no module gpucomm.{parts[0]}, and gpucomm has no attribute {parts[0]!r}"
    return None


def test_the_docs_are_read() -> None:
    paths = {path for _, path, _ in _paths()}
    assert "gpucomm/workspace/engine.py" in paths
    assert "kernels/triton/program.py" in paths
    assert any(path.startswith("tests/") for path in paths)
    assert any(test for _, _, test in _paths())
    assert not any(path.startswith("docs/results") for path in paths)
    # What the patterns take and leave, on made-up lines.
    line = "(`gpucomm/ops/*_ops.py`, kernels/host/, tests/a/test_b.py::test_c.) gpucomm/<token>/ gpucomm/nccl"
    taken = [(m.group(1), m.group(2)) for m in _PATH.finditer(line)]
    assert taken == [
        ("gpucomm/ops/*_ops.py", None),
        ("kernels/host/", None),
        ("tests/a/test_b.py", "::test_c"),
        ("gpucomm/nccl", None),  # taken, then skipped by _paths: not .py, no trailing /
    ]
    assert _module_problem("gpucomm.workspace.channels.granule") is None
    assert _module_problem("gpucomm._bench.host_time") is None
    assert _module_problem("gpucomm.all_reduce") is None
    assert _module_problem("gpucomm.engine") is not None
    assert _module_problem("gpucomm.workspace.channels.no_such_name") is not None


def test_every_path_in_the_docs_exists() -> None:
    missing = [f"{where}: {path}" for where, path, _ in _paths() if not _exists(path)]
    assert not missing, "paths in the docs that name nothing in the repository:\n" + "\n".join(missing)


def test_every_test_named_in_the_docs_exists() -> None:
    missing = []
    for where, path, test in _paths():
        if test is None or not _exists(path):
            continue
        if not re.search(rf"^\s*(?:async\s+)?def {re.escape(test)}\b", (_REPO / path).read_text(), re.M):
            missing.append(f"{where}: {path}::{test}")
    assert not missing, "tests named in the docs that their file does not define:\n" + "\n".join(missing)


def test_every_module_named_in_the_docs_exists() -> None:
    problems = []
    for where, m in _mentions(_MODULE):
        problem = _module_problem(m.group(0))
        if problem is not None:
            problems.append(f"{where}: {m.group(0)}: {problem}")
    assert not problems, "module names in the docs that name nothing:\n" + "\n".join(problems)


def _layer_rows() -> list[tuple[list[str], list[str]]]:
    """docs/architecture.md's table of layers: per row, the folders and modules it names (column
    two) and the bare file names its job names (column three), bottom first."""
    text = (_REPO / "docs" / "architecture.md").read_text()
    section = text.split("## The folders are the layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[0].isdigit():
            rows.append((re.findall(r"`(gpucomm/[\w./]*)`", cells[1]), re.findall(r"`(\w+\.py)`", cells[2])))
    return rows


def _module_of(path: str) -> str:
    """``gpucomm/ops/`` -> ``gpucomm.ops``; ``gpucomm/log.py`` -> ``gpucomm.log``; the package's
    ``__init__.py`` -> ``gpucomm``."""
    path = path.removesuffix("/").removesuffix(".py").removesuffix("/__init__")
    return path.replace("/", ".")


def test_the_layers_drawn_are_the_layers_checked() -> None:
    # Loaded from its file: a test module is no package, and its folder need not be on sys.path.
    spec = importlib.util.spec_from_file_location("_import_graph", _REPO / "tests" / "test_import_graph.py")
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)

    drawn = [{_module_of(path) for path in paths} for paths, _ in _layer_rows()]
    assert drawn == [set(layer) for layer in graph.LAYERS], "docs/architecture.md's layers differ from LAYERS"
    missing = []
    for paths, files in _layer_rows():
        folders = [_REPO / path for path in paths if path.endswith("/")]
        missing += [f"{name} (in {paths})" for name in files if not any((f / name).is_file() for f in folders)]
    assert not missing, "files that docs/architecture.md's layers name and their folders lack:\n" + "\n".join(missing)
