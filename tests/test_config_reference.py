"""docs/config-reference.md is what scripts/gen_config_reference.py writes from the field
docstrings in stapo_megatron/config.py: a changed field or docstring without regenerating fails."""

import dataclasses
import os
import runpy

from stapo_megatron.config import TrainerConfig, WarmStartConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = runpy.run_path(os.path.join(REPO, "scripts", "gen_config_reference.py"))


def test_committed_reference_equals_the_generated_one():
    with open(os.path.join(REPO, "docs", "config-reference.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == SCRIPT["render"](), "run: python scripts/gen_config_reference.py"


def test_reference_lists_every_field():
    text = SCRIPT["render"]()

    def keys(cls, prefix=""):
        for field in dataclasses.fields(cls):
            yield f"{prefix}{field.name}"
            if dataclasses.is_dataclass(field.default_factory):  # a section (MISSING is no dataclass)
                yield from keys(field.default_factory, f"{prefix}{field.name}.")

    names = list(keys(TrainerConfig)) + list(keys(WarmStartConfig, "warmstart."))
    assert "loss.tau_p" in names and "warmstart.label_smoothing" in names
    for name in names:
        assert f"| `{name}` |" in text, name
