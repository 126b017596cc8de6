"""The tiny Qwen3-MoE policy (4 experts, top-2) the rollout-engine tests share: its HF folder (a
module fixture), the prompts, transformers' own model of the folder, and the engines' tolerance."""

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model

LOGPROB_ATOL = 1e-4
"""Absolute per-token tolerance between engines, both fp32: vLLM's and HF's attention, RMSNorm
and expert kernels round differently (~1e-6); a wrong expert slice moves log-probs by O(0.1)."""

PROMPTS = [[5, 17, 200, 3], [42] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe") / "hf")
    save_tiny_hf_model(path, "qwen3-moe", dtype=torch.float32, seed=0)
    return path


def _hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
