"""The package's shape as tests: no import circle, small modules, a light config tree.

The import graph is read from the source (every ``import`` statement, at module level, in
TYPE_CHECKING blocks and inside functions alike: an import deferred into a function still runs
the imported module when called, and a circle it closes is one a module-level import would
show): an edge from a module to each package module it imports and to that module's parent
packages (Python runs their ``__init__`` first), except the importer's own parents.
"""

import ast
import os
import re
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


def _imports(tree: ast.Module, module: str, is_package: bool):
    """Dotted names imported anywhere in the module (module docstring)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def _graph():
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        own_parents = {module.rsplit(".", i)[0] for i in range(module.count(".") + 1)}
        edges = set()
        for name in _imports(tree, module, path.endswith("__init__.py")):
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


def test_an_import_inside_a_function_is_an_edge():
    source = ("import stapo_megatron.utils\n"
              "def f():\n    from stapo_megatron.config import overrides\n"
              "class C:\n    def g(self):\n        if True:\n            import stapo_megatron.rollout.base\n")
    names = _imports(ast.parse(source), "stapo_megatron.eval.config", False)
    assert set(names) == {"stapo_megatron.utils", "stapo_megatron.config", "stapo_megatron.config.overrides",
                          "stapo_megatron.rollout.base"}


FLOORS = (
    ("utils",),
    ("ops", "method", "batch", "rewards"),
    ("mcore", "data"),
    ("bridge",),
    ("rollout", "conversion"),
    ("serve",),
    ("config",),
    ("eval",),
    ("recipes",),
    ("runlog",),
    ("trainer",),
    ("doctor", "launch"),
)
"""The wings from the ground floor up: a wing imports only the wings of the floors below it."""
ARROWS_UP = {
    ("config", "eval"), ("config", "runlog"), ("config", "trainer"),  # the tree composes the sections they own
}
"""The imports that run up the floors (wing -> wing). Remove one when it goes; never add one."""


def _wing(module):
    return module.split(".")[1] if "." in module else "(package)"


def test_the_wings_stand_on_their_floors():
    floor = {wing: i for i, wings in enumerate(FLOORS) for wing in wings}
    graph = _graph()
    unplaced = sorted({_wing(m) for m in graph} - set(floor) - {"(package)"})
    assert not unplaced, f"wings without a floor in FLOORS: {unplaced}"
    up = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = _wing(module), _wing(target)
            if a != b and "(package)" not in (a, b) and floor[b] >= floor[a]:
                up.setdefault((a, b), []).append(f"{module} -> {target}")
    assert not set(up) - ARROWS_UP, {arrow: up[arrow] for arrow in set(up) - ARROWS_UP}
    assert not ARROWS_UP - set(up), f"gone, remove from ARROWS_UP: {sorted(ARROWS_UP - set(up))}"


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


TESTS = os.path.join(os.path.dirname(ROOT), "tests")
TESTED_IN = {
    "stapo_megatron.conversion.safetensors_io": "tests/conversion/test_roundtrip.py",
    "stapo_megatron.eval.generate": "tests/eval/test_cli.py",
    "stapo_megatron.launch.shipping": "tests/integration/test_launch.py",
    "stapo_megatron.batch.microbatch": "tests/batch/test_packing.py",
    "stapo_megatron.mcore.loss_metrics": "tests/method/test_rollout_correction.py",
    "stapo_megatron.mcore.parallel": "tests/integration/test_context_parallel_training.py",
    "stapo_megatron.batch.records": "tests/batch/test_minibatches.py",
    "stapo_megatron.mcore.schedule": "tests/mcore/test_router_replay.py",
    "stapo_megatron.mcore.step": "tests/integration/test_context_parallel_training.py",
    "stapo_megatron.recipes.synthetic": "tests/integration/test_context_parallel_training.py",
    "stapo_megatron.trainer.loop": "tests/integration/test_eval_sets.py",
    "stapo_megatron.trainer.pool_ledger": "tests/serve/test_partial.py",
}
"""Modules whose tests are not in ``tests/<wing>/test_<module>.py``: the file that tests them (it
imports the module or names of it, itself or through the ``tests/helpers/`` module of its
workers). Everything else has its test file of that name."""
TESTED_THROUGH = {
    "stapo_megatron.bridge.norm": ("tests/bridge/test_model.py", "stapo_megatron.bridge.model"),
    "stapo_megatron.launch.jobs": ("tests/integration/test_launch.py", "stapo_megatron.launch.cli"),
    "stapo_megatron.mcore.checkpoint_optimizer": ("tests/integration/test_checkpoint_recipes.py",
                                                  "stapo_megatron.mcore.checkpoint"),
    "stapo_megatron.conversion.publish": ("tests/conversion/test_mcore_to_hf.py",
                                          "stapo_megatron.conversion.mcore_to_hf"),
    "stapo_megatron.rollout.spmd": ("tests/integration/test_context_parallel_training.py",
                                    "stapo_megatron.eval.evaluator"),
    "stapo_megatron.trainer.replicas": ("tests/integration/test_eval_sets.py", "stapo_megatron.trainer.loop"),
}
"""Modules only a caller's tests reach: (test file, the calling module, which that file tests)."""


def _public_names(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]


def _tests_module(test_file, module):
    """Whether ``test_file`` imports ``module`` or one of its public names, itself or through a
    ``tests/helpers/`` module it imports (where shared workers live); this file, which names every
    module in its tables, does not count."""
    if os.path.basename(test_file) == os.path.basename(__file__):
        return False
    with open(os.path.join(TESTS, os.path.relpath(test_file, "tests"))) as f:
        text = f.read()
    for helper in sorted(set(re.findall(r"\btests\.helpers\.(\w+)", text))):
        if os.path.isfile(os.path.join(TESTS, "helpers", f"{helper}.py")):
            with open(os.path.join(TESTS, "helpers", f"{helper}.py")) as f:
                text += "\n" + f.read()
    parent, leaf = module.rsplit(".", 1)
    if re.search(rf"\b{re.escape(module)}\b", text) or re.search(rf"from {re.escape(parent)} import [^\n]*\b{leaf}\b", text):
        return True
    path = _modules()[module]
    return any(re.search(rf"\bimport [^\n]*\b{name}\b", text) for name in _public_names(path))


def test_every_module_has_its_test_file_or_says_where_it_is_tested():
    """A newcomer finds a module's tests by name (tests/<wing>/test_<module>.py) or in the table
    above, which must stay true: the named file exists and imports the module (or its caller)."""
    problems = []
    for module, path in sorted(_modules().items()):
        if path.endswith("__init__.py"):
            continue
        own = _own_test_file(module)
        if os.path.isfile(own):
            continue
        if module in TESTED_IN:
            if not _tests_module(TESTED_IN[module], module):
                problems.append(f"{module}: {TESTED_IN[module]} does not import it")
        elif module in TESTED_THROUGH:
            test_file, caller = TESTED_THROUGH[module]
            if module not in _module_level_imports_of(caller) or not _tests_module(test_file, caller):
                problems.append(f"{module}: {caller} does not import it or {test_file} does not test {caller}")
        else:
            problems.append(f"{module} has no {os.path.relpath(own, os.path.dirname(TESTS))} and is not in TESTED_IN")
    listed = list(TESTED_IN) + list(TESTED_THROUGH)
    stale = [f"{m}: listed but not a module" for m in listed if m not in _modules()]
    stale += [f"{m}: listed but has {os.path.relpath(_own_test_file(m), os.path.dirname(TESTS))}"
              for m in listed if m in _modules() and os.path.isfile(_own_test_file(m))]
    stale += [f"{f}: listed but not a file" for f in list(TESTED_IN.values()) + [f for f, _ in TESTED_THROUGH.values()]
              if not os.path.isfile(os.path.join(os.path.dirname(TESTS), f))]
    assert not problems and not stale, "\n".join(problems + stale)


def _own_test_file(module):
    """tests/<wing>/test_<module>.py of a module of the package."""
    rel = os.path.relpath(_modules()[module], ROOT)[:-3].split(os.sep)
    return os.path.join(TESTS, *rel[:-1], f"test_{rel[-1]}.py")


def _module_level_imports_of(module):
    path = _modules()[module]
    with open(path) as f:
        tree = ast.parse(f.read())
    names = []
    for node in ast.walk(tree):  # imports inside functions count: the caller runs them
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names
