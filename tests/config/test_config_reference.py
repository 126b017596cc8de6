"""docs/config-reference.md is what scripts/gen_config_reference.py writes from the field
docstrings in stapo_megatron/config.py: a changed field or docstring without regenerating fails."""

import dataclasses
import os
import runpy

from stapo_megatron.config import TrainerConfig, WarmStartConfig
from tests.helpers import REPO_DIR

REPO = REPO_DIR
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


def test_reference_lists_the_eval_set_fields_and_whole_summaries():
    """EvalSetConfig's fields are listed; each section's summary is a whole sentence (the first
    docstring line of LoggingConfig ended in "see"); evaluation sets name their length limit."""
    import re

    from stapo_megatron.eval.config import EvalSetConfig

    text = SCRIPT["render"]()
    for field in dataclasses.fields(EvalSetConfig):
        assert f"| `{field.name}` |" in text.split("## Each of `eval.sets`: EvalSetConfig")[1], field.name
    for summary in re.findall(r"^## .*\n\n(.*)\n", text, re.M):
        assert summary.rstrip().endswith((".", ")")), summary
    eval_sets = next(line for line in text.splitlines() if line.startswith("| `eval.sets` |"))
    assert "``max_response_len``" in eval_sets and "rollout.max_response_len" not in eval_sets
    for old, new in TrainerConfig.RENAMED_FIELDS.items():
        assert f"| `{old}` | `{new}` |" in text
