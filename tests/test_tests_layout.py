"""The test tree's shape as tests: it mirrors the package.

- No test file imports another test file: what several test files share (gloo workers, fixtures,
  reference computations) lives in ``tests/helpers/``, named by what it holds.
- No two test files share a name, except the test files of same-named modules of different wings
  (``tests/launch/test_cli.py`` and ``tests/eval/test_cli.py``): a multi-process or end-to-end
  test in ``tests/integration/`` is named apart from the unit tests it extends.
- Most modules have a test file of their own name, ``tests/<wing>/test_<module>.py``; the rest are
  listed in ``tests/test_package_layout.py``'s tables.
"""

import ast
import collections
import os

import stapo_megatron

PACKAGE = os.path.dirname(stapo_megatron.__file__)
TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
MIN_OWN_TEST_FILE_SHARE = 0.80
"""Of the package's modules (``__init__.py`` files aside), the share with a test file of their name."""

SHARED_FROM_TEST_FILES = {
    ("tests/integration/test_context_parallel_training.py", "tests.batch.test_context_parallel"),
    ("tests/integration/test_moe_context_parallel.py", "tests.batch.test_context_parallel"),
    ("tests/integration/test_logit_grad_tp.py", "tests.ops.test_logit_grad"),
    ("tests/integration/test_triton_path_tp.py", "tests.ops.test_triton_path"),
    ("tests/batch/test_packing.py", "tests.rollout.test_vllm_engine"),
}
"""(test file, test module it imports) whose shared code has still to move to tests/helpers/;
nothing may join, and an entry that no longer holds fails (remove it)."""
SHARED_NAMES = set()
"""Test-file names still held by an integration file and a unit file (to be named apart)."""


def _test_files():
    """Repository-relative paths of every ``test_*.py`` under tests/."""
    out = []
    for folder, _, files in os.walk(TESTS):
        out += [os.path.relpath(os.path.join(folder, f), REPO) for f in files
                if f.startswith("test_") and f.endswith(".py")]
    return sorted(out)


def _imported_test_modules(path):
    """Dotted names of the test modules (``tests....test_*``) that a file imports, at any depth."""
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            candidates = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in candidates:
            parts = name.split(".")
            test_parts = [i for i, part in enumerate(parts) if part.startswith("test_")]
            if parts[0] == "tests" and test_parts:
                names.add(".".join(parts[: test_parts[0] + 1]))
    return names


def _modules():
    """Package-relative paths (without ``.py``) of the package's modules, ``__init__`` aside."""
    out = []
    for folder, _, files in os.walk(PACKAGE):
        out += [os.path.relpath(os.path.join(folder, f), PACKAGE)[:-3] for f in files
                if f.endswith(".py") and f != "__init__.py"]
    return sorted(out)


def _own_test_file(module):
    wing, name = os.path.split(module)
    return os.path.join(TESTS, wing, f"test_{name}.py")


def test_no_test_file_imports_another_test_file():
    edges = {(path, module) for path in _test_files() for module in _imported_test_modules(path)}
    assert not edges - SHARED_FROM_TEST_FILES, sorted(edges - SHARED_FROM_TEST_FILES)
    assert not SHARED_FROM_TEST_FILES - edges, f"no longer imported: {sorted(SHARED_FROM_TEST_FILES - edges)}"


def test_the_import_reader_sees_every_form(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("import tests.a.test_b\nfrom tests.c import test_d\nfrom tests.e.test_f import g\n"
                    "def f():\n    from tests.helpers.h import i\n    from tests.j.test_k import l\n")
    assert _imported_test_modules(path) == {"tests.a.test_b", "tests.c.test_d", "tests.e.test_f", "tests.j.test_k"}


def test_no_two_test_files_share_a_name_unless_they_mirror_same_named_modules():
    by_name = collections.defaultdict(list)
    for path in _test_files():
        by_name[os.path.basename(path)].append(path)
    mirrors = {os.path.relpath(_own_test_file(m), REPO) for m in _modules()}
    shared = {name: paths for name, paths in by_name.items()
              if len(paths) > 1 and not set(paths) <= mirrors}
    assert set(shared) <= SHARED_NAMES, {n: p for n, p in shared.items() if n not in SHARED_NAMES}
    assert not SHARED_NAMES - set(shared), f"no longer shared: {sorted(SHARED_NAMES - set(shared))}"


def test_most_modules_have_a_test_file_of_their_own_name():
    modules = _modules()
    own = [m for m in modules if os.path.isfile(_own_test_file(m))]
    assert len(modules) > 100  # the walk found the package
    missing = sorted(set(modules) - set(own))
    assert len(own) / len(modules) >= MIN_OWN_TEST_FILE_SHARE, (
        f"{len(own)} of {len(modules)} modules have tests/<wing>/test_<module>.py; without one: {missing}")
