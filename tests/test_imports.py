"""The code's shape: no import cycle among msinfer's modules (an import inside a function counts:
it runs too), so that each side of a seam can be read, tested and replaced without the other."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def import_graph() -> dict[str, set[str]]:
    """msinfer module -> the msinfer modules it imports anywhere in its source."""
    mods = {f"msinfer.{pkg}.{f.stem}": f for pkg in ("launcher", "worker", "sharding")
            for f in (ROOT / pkg).glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("msinfer."):
                named = {f"{node.module}.{a.name}" for a in node.names}
                graph[m] |= ({node.module} | named) & mods.keys()
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names} & mods.keys()
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]    # the check finds one
    graph = import_graph()
    assert len(graph) > 40 and "msinfer.worker.ops" in graph["msinfer.worker.cpu"]
    assert cycles(graph) == []


@pytest.mark.slow          # a process of its own
def test_a_worker_imports_mindspore_with_its_objects_frozen_and_the_collector_back_on():
    """worker.imports.import_mindspore, which Worker.join calls: what MindSpore's import made is in
    the collector's permanent generation, which later collections (many while graphs compile) do
    not walk, and the collector is on again afterwards; a second call returns the same module.
    MindSpore's import leaves protobuf's implementation as it was (upb, unless the user chose
    another) and its PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION out of what later processes inherit."""
    import os
    import subprocess
    import sys
    code = ("import gc, os, sys\n"
            "from msinfer.worker.imports import import_mindspore\n"
            "ms = import_mindspore()\n"
            "from google.protobuf.internal import api_implementation\n"
            "print(gc.isenabled(), gc.get_freeze_count(), ms is sys.modules['mindspore'], import_mindspore() is ms,\n"
            "      api_implementation.Type(), os.environ.get('PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION'))\n")
    env = {k: v for k, v in os.environ.items() if k != "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    enabled, frozen, imported, again, protobuf, variable = p.stdout.split()
    assert enabled == imported == again == "True" and int(frozen) > 100_000
    assert (protobuf, variable) == ("upb", "None")
    code = code.replace("print(gc.isenabled(), gc.get_freeze_count(), ms is sys.modules['mindspore'], "
                        "import_mindspore() is ms,\n      ", "print(")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["python", "python"]          # the user's choice stands
