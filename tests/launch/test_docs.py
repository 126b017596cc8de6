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


def _jobs_at_4h(size):
    """Jobs a paper recipe's 3,000 steps need in 4 h jobs (`launch.timing`'s estimate)."""
    from stapo_megatron.launch.entry import build_config
    from stapo_megatron.recipes import paper, step_time

    cfg = build_config(size, check_paths=False)[0]
    step = step_time.estimate_step_time(paper.ARCHITECTURES[size], paper.layout_for(size, cfg), cfg)
    return step_time.jobs_needed(cfg.steps, step, 4 * 3600, step_time.signal_seconds(step))


def test_the_readme_job_counts_are_the_estimates():
    """The README's range of jobs per paper recipe at 4 h said 75-100 while the dry runs print
    71-99 (the 30B-A3B's retries, 103, are its 99 jobs plus the failure allowance)."""
    jobs = {size: _jobs_at_4h(size) for size in ("qwen3_1p7b", "qwen3_8b", "qwen3_14b", "qwen3_30b_a3b")}
    text = " ".join(read("README.md").split())
    assert f"every paper recipe with 4 h jobs: {min(jobs.values())}-{max(jobs.values())}," in text, jobs
    assert f"`stapo_8b_32k` ~{round(_jobs_at_4h('qwen3_8b_32k'), -1)}," in text
