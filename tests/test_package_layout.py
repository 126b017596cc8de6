"""The package's shape as tests: no import circle, small modules, a light config tree.

The import graph is read from the source (every ``import`` at module level, TYPE_CHECKING
blocks included, imports inside functions excluded): an edge from a module to each package
module it imports and to that module's parent packages (Python runs their ``__init__`` first),
except the importer's own parents.
"""

import ast
import os
import subprocess
import sys

import pytest

import stapo_megatron

ROOT = os.path.dirname(stapo_megatron.__file__)
MAX_MODULE_LINES = 450
"""README, "Package map": a module that outgrows this is split by what it owns."""


def _modules():
    """{dotted name: source path} of every module of the package."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(ROOT))[:-3].split(os.sep)
                out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(folder, name)
    return out


def _module_level_imports(tree: ast.Module, module: str, is_package: bool):
    """Dotted names imported by the statements outside functions and classes."""
    names = []
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            stack += [n for field in ("body", "orelse", "finalbody") for n in getattr(node, field, [])]
            stack += [n for h in getattr(node, "handlers", []) for n in h.body]
    return names


def _graph():
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        own_parents = {module.rsplit(".", i)[0] for i in range(module.count(".") + 1)}
        edges = set()
        for name in _module_level_imports(tree, module, path.endswith("__init__.py")):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in modules and target != module and target not in own_parents:
                    edges.add(target)
        graph[module] = edges
    return graph


def _cycle(graph):
    """One import circle as a list of modules, or None."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_in_the_package():
    graph = _graph()
    assert len(graph) > 60 and "stapo_megatron.config.tree" in graph  # the walk found the package
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_circle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_over_the_line_limit():
    sizes = {m: sum(1 for _ in open(p)) for m, p in _modules().items()}
    assert not {m: n for m, n in sizes.items() if n > MAX_MODULE_LINES}


def test_the_trainer_module_is_its_loop():
    path = _modules()["stapo_megatron.trainer.loop"]
    source = open(path).read()
    assert source.count("\n") < 300
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert not long


@pytest.mark.parametrize("module", ["stapo_megatron.config", "stapo_megatron.rollout.registry",
                                    "stapo_megatron.rollout.base"])
def test_light_modules_import_no_megatron_vllm_or_transformers(module):
    code = (f"import sys, {module}; heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('megatron', 'vllm', 'transformers', 'nemo_run', 'transformer_engine')); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
