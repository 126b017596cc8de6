"""What the README and the config reference say about the launch-side facts of issue 36 item 10
matches the code: vLLM's sleep level during training, and which ratio icepop bounds."""

import os
import re
from tests.helpers import REPO_DIR

REPO = REPO_DIR


def read(*parts):
    with open(os.path.join(REPO, *parts), encoding="utf-8") as f:
        return f.read()


def test_the_readme_names_the_sleep_level_the_trainer_uses():
    levels = set(re.findall(r"sleep_level=(\d)", read("stapo_megatron", "trainer", "engine_server.py")))  # the engine config
    assert levels == {"2"}, levels
    said = set(re.findall(r"sleep(?:s)?\s*\(?\s*(?:at\s+)?level\s+(\d)", read("README.md")))
    assert said == levels, said


def test_the_config_reference_says_which_ratio_icepop_bounds():
    row = next(line for line in read("docs", "config-reference.md").splitlines()
               if line.startswith("| `loss.rollout_correction.mode`"))
    assert "rho = pi_old/pi_rollout is outside [token_lower, token_upper]" in row
    assert "rho itself is bounded" in row and "verl's code bounds 1/rho = pi_rollout/pi_old" in row
    # and the code bounds that ratio: delta = log pi_old - log pi_rollout, flagged outside the bounds
    code = read("stapo_megatron", "method", "rollout_correction.py")
    assert "return old_logprob.to(dtype) - rollout_logprob.to(dtype)" in code
    assert "_outside(delta_BS, config.token_lower, config.token_upper)" in code
