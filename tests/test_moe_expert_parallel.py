"""Tier b: expert-parallel STAPO training on 2 gloo processes. One policy update at EP=2 (each
rank holds 2 of the 4 experts; tokens travel by all-to-all) equals the same update at EP=1 (both
data-parallel ranks hold all experts) on the same per-rank batches: loss, grad norm, MoE metrics
and every gradient, experts matched by their global index."""

import re

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.conversion.cli import main
from tests.dist_utils import run_distributed

VARIANT = "qwen3-moe"
PROMPT, RESPONSE, MBS = 6, 10, 2
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7
"""fp32; the same sums in another order (expert gradients accumulate the two ranks' tokens in
all-to-all order at EP=2, per rank then all-reduced at EP=1): a few ulps."""


def _global_name(name, ep_rank, num_local):
    """``...local_experts.<j>...`` -> ``...local_experts.<global index>...``."""
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * num_local + int(m.group(1))}.", name)


def _ep_worker(ckpt):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.train.config import OptimConfig
    from stapo_megatron.train.parallel import init_parallel
    from stapo_megatron.train.schedule import PassContext, old_policy_pass
    from stapo_megatron.train.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.train.synthetic import synthetic_rollouts

    out = {}
    for ep in (1, 2):
        groups = init_parallel(1, 1, expert_model_parallel_size=ep)
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, calculate_per_token_loss=True)
        load_checkpoint(model, ckpt)
        ddp, optimizer = wrap_model_and_optimizer(model, OptimConfig(optimizer="sgd", lr=0.1, weight_decay=0.0,
                                                                     clip_grad=0.0))
        dp_rank = dist.get_rank(groups.dp)
        mbs, _ = synthetic_rollouts(2, 4, PROMPT, RESPONSE, 300, seed=7 + dp_rank, micro_batch_size=MBS)
        ctx = PassContext(ddp, PROMPT + RESPONSE, groups=groups, vocab_size=300)
        old_policy_pass(ctx, [mbs])
        metrics = policy_update(ctx, optimizer, mbs, LossConfig(tau_p=0.05))
        num_local = len(model.decoder.layers[0].mlp.experts.local_experts)
        ep_rank = ps.get_expert_model_parallel_rank()
        grads = {_global_name(n.removeprefix("module."), ep_rank, num_local): p.main_grad.clone()
                 for n, p in ddp.named_parameters()}
        out[ep] = dict(grads=grads, num_local=num_local,
                       metrics={k: v for k, v in metrics.items() if isinstance(v, float)})
        ps.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_ep2_update_equals_ep1(tmp_path):
    hf, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    save_tiny_hf_model(hf, VARIANT, dtype=torch.float32)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    ranks = run_distributed(2, _ep_worker, ckpt)
    assert [r[1]["num_local"] for r in ranks] == [4, 4] and [r[2]["num_local"] for r in ranks] == [2, 2]
    for rank, r in enumerate(ranks):
        ep1, ep2 = r[1], r[2]
        for key in ("loss", "grad_norm", "moe/aux_loss", "moe/layer0/max_load", "moe/layer3/max_over_mean"):
            assert ep2["metrics"][key] == pytest.approx(ep1["metrics"][key], rel=GRAD_RTOL), key
        assert ep1["metrics"]["loss"] != 0.0 and ep1["metrics"]["grad_norm"] > 0.0
        assert set(ep2["grads"]) <= set(ep1["grads"])
        for name, grad in ep2["grads"].items():
            torch.testing.assert_close(grad, ep1["grads"][name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
    # together the two EP=2 ranks hold every expert's gradient
    held = set(ranks[0][2]["grads"]) | set(ranks[1][2]["grads"])
    assert held == set(ranks[0][1]["grads"])
