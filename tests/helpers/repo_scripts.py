"""The repository's ``scripts/`` files, loaded as modules (the folder is not a package)."""

import importlib.util
import os

from tests.helpers import REPO_DIR


def load_script(name: str):
    """``scripts/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_DIR, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare_metrics = load_script("compare_metrics")
