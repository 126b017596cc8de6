"""Tier c: on a CUDA machine the transformer-engine layer spec loads a converted checkpoint and
gives transformers' logits. (Tier b, Megatron logits from converted checkpoints at (TP, PP) =
(1,1), (2,1), (1,2), (2,2) and Megatron's own saves exporting back bit-exactly, is
``tests/integration/test_conversion_parity.py``.)
"""

import importlib.util

import pytest
import torch

from stapo_megatron.conversion.verify import compare, fixed_prompts, hf_logits
from stapo_megatron.bridge.tiny import tiny_config
from tests.helpers.conversion_parity import converted  # noqa: F401  (the fixture)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (transformer-engine layer spec)")
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="transformer-engine is not installed")
def test_te_spec_loads_the_same_checkpoint(converted):  # noqa: F811
    from stapo_megatron.conversion.verify import megatron_logits

    _, jobs = converted
    _, hf, ckpt = jobs[2]
    tokens_BS = fixed_prompts(300)
    # On a CUDA machine build_gpt_model picks the transformer-engine spec automatically.
    got = megatron_logits(ckpt, tiny_config("qwen3"), [(1, 1)], tokens_BS)[(1, 1)]
    row = compare(hf_logits(hf, tokens_BS), got, 1, 1)
    assert row.top1_agreement == 1.0 and row.max_abs_diff < 1e-3, row


def test_a_delta_net_model_is_judged_by_the_hybrid_tolerance():
    """`stapo-convert verify` without ``--tol``: Qwen3.5's delta-net models by HYBRID_LOGIT_TOL (the
    two sides' chunked delta rules in different orders), every other model by FP32_LOGIT_TOL."""
    from stapo_megatron.bridge.hf_config import spec_from_hf_config
    from stapo_megatron.conversion.verify import FP32_LOGIT_TOL, HYBRID_LOGIT_TOL, default_tolerance

    assert default_tolerance(spec_from_hf_config(tiny_config("qwen3.5"))) == HYBRID_LOGIT_TOL == 3 * FP32_LOGIT_TOL
    assert default_tolerance(spec_from_hf_config(tiny_config("qwen3"))) == FP32_LOGIT_TOL
