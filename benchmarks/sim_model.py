"""The cost model under the rollout-schedule simulator (`sim_schedules.py`), and what only the
simulator needs: model shapes of the calibration cases, sampled prompts and lengths.

The cost model itself (hardware, `Efficiency`, the length distribution, one vLLM engine's decode
iteration `DecodeModel`, the training phases, the weight switch) lives in the package,
`stapo_megatron.recipes.step_model`, so that the dry run's step estimate and this simulator read
the same model; it is imported here under its old names. Its efficiency figures are fitted to two
published runs (`sim_calibrate.py`: NeMo-RL's Llama-3.1-8B GRPO and verl fully-async's
Qwen2.5-Math-7B phase table); every other figure is a stated datasheet value or prior.
"""

from __future__ import annotations

import math
import random
from typing import List, Sequence

from stapo_megatron.recipes.step_model import (H20, H100, PAPER_LENGTHS, DecodeModel, Efficiency,  # noqa: F401
                                                  Hardware, Lengths, ModelSpec, Prompt, decode_model,
                                                  switch_s, train_phase_s, trainer_s)

QWEN3_8B = ModelSpec("Qwen3-8B", params=8.19e9, num_layers=36, attn_width=4096, kv_heads=8)
LLAMA31_8B = ModelSpec("Llama-3.1-8B", params=8.03e9, num_layers=32, attn_width=4096, kv_heads=8)
QWEN25_MATH_7B = ModelSpec("Qwen2.5-Math-7B", params=7.62e9, num_layers=28, attn_width=3584, kv_heads=4)
QWEN3_30B_A3B = ModelSpec("Qwen3-30B-A3B", params=30.5e9, num_layers=48, attn_width=4096, kv_heads=4,
                          active_params=3.35e9, expert_params=29.0e9, expert_share=8 / 128)
"""Its HF config.json: 48 layers of 32 query and 4 KV heads of 128 and an MoE of 128 experts of
width 768 (top-8), hidden 2048, 151,936 tokens untied: 30.5B parameters, 29.0B of them in experts
(48 x 128 x 3 x 2048 x 768), 3.35B a token (attention 18.9M, 8 experts 37.7M and the router 0.26M
a layer, and both embeddings, counted as the dense models' are)."""


def sample_prompts(lengths: Lengths, num: int, group: int, seed: int, first_index: int = 0) -> List[Prompt]:
    """``num`` prompts with ``group`` response lengths each."""
    rng = random.Random(seed)
    mu, s = math.log(lengths.response_median), lengths.response_sigma
    return [Prompt(first_index + i, rng.randint(*lengths.prompt_range),
                   [min(lengths.response_cap, max(1, int(math.exp(mu + s * rng.gauss(0, 1))))) for _ in range(group)])
            for i in range(num)]


def sample_tokens(prompts: Sequence[Prompt]) -> List[int]:
    """Prompt + response length of every sample of ``prompts``."""
    return [p.prompt_len + r for p in prompts for r in p.responses]
