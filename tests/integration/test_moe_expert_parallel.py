"""Tier b: expert-parallel STAPO training on 2 gloo processes. One policy update at EP=2 (each
rank holds 2 of the 4 experts; tokens travel by all-to-all) equals the same update at EP=1 (both
data-parallel ranks hold all experts) on the same per-rank batches: loss, grad norm, MoE metrics
and every gradient, experts matched by their global index. A trainer checkpoint (model and Adam
state) saved at EP=2 is refused at EP=1 naming the reason (megatron-core chains a separate expert
optimizer at EP > 1, so the optimizer state does not reshard), while its model weights load at
EP=1 and give the EP=2 run's parameters."""

import re

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.conversion.cli import main
from tests.helpers.dist_utils import run_distributed

VARIANT = "qwen3-moe"
PROMPT, RESPONSE, MBS = 6, 10, 2
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7
"""fp32; the same sums in another order (expert gradients accumulate the two ranks' tokens in
all-to-all order at EP=2, per rank then all-reduced at EP=1): a few ulps."""


def _global_name(name, ep_rank, num_local):
    """``...local_experts.<j>...`` -> ``...local_experts.<global index>...``."""
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * num_local + int(m.group(1))}.", name)


def _ep_worker(ckpt, run_dir):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.checkpoint import load_checkpoint as load_trainer_checkpoint
    from stapo_megatron.mcore.checkpoint import save_checkpoint
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import synthetic_rollouts

    def setup(ep, load=True):
        groups = init_parallel(1, 1, expert_model_parallel_size=ep)
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, calculate_per_token_loss=True)
        if load:
            load_checkpoint(model, ckpt)
        ddp, optimizer = wrap_model_and_optimizer(model, OptimConfig(optimizer="adam", lr=1e-3, weight_decay=0.0,
                                                                     clip_grad=0.0))
        return groups, model, ddp, optimizer

    def update(groups, ddp, optimizer, seed):
        mbs, _ = synthetic_rollouts(2, 4, PROMPT, RESPONSE, 300, seed=seed + dist.get_rank(groups.dp),
                                    micro_batch_size=MBS)
        ctx = PassContext(ddp, PROMPT + RESPONSE, groups=groups, vocab_size=300)
        old_policy_pass(ctx, [mbs])
        return {k: v for k, v in policy_update(ctx, optimizer, mbs, LossConfig(tau_p=0.05)).metrics.items()
                if isinstance(v, float)}

    def by_global_name(model, ddp, attr):
        num_local = len(model.decoder.layers[0].mlp.experts.local_experts)
        ep_rank = ps.get_expert_model_parallel_rank()
        return {_global_name(n.removeprefix("module."), ep_rank, num_local): getattr(p, attr).detach().clone()
                for n, p in ddp.named_parameters()}, num_local

    out = {}
    for ep in (1, 2):
        groups, model, ddp, optimizer = setup(ep)
        metrics = update(groups, ddp, optimizer, seed=7)
        grads, num_local = by_global_name(model, ddp, "main_grad")
        out[ep] = dict(grads=grads, num_local=num_local, metrics=metrics)
        if ep == 2:
            saved = save_checkpoint(run_dir, 1, ddp, optimizer, {})
            out["ep2_saved"] = by_global_name(model, ddp, "data")[0]
        ps.destroy_model_parallel()
    groups, model, ddp, optimizer = setup(1, load=False)
    try:
        load_trainer_checkpoint(saved, ddp, optimizer)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    load_checkpoint(model, saved)  # the weights alone (a warm start) load at EP=1
    out["ep1_weights"] = by_global_name(model, ddp, "data")[0]
    return out


@pytest.mark.slow
def test_ep2_update_equals_ep1(tmp_path):
    hf, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    save_tiny_hf_model(hf, VARIANT, dtype=torch.float32)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    ranks = run_distributed(2, _ep_worker, ckpt, str(tmp_path / "run"))
    assert [r[1]["num_local"] for r in ranks] == [4, 4] and [r[2]["num_local"] for r in ranks] == [2, 2]
    for rank, r in enumerate(ranks):
        ep1, ep2 = r[1], r[2]
        for key in ("loss", "grad_norm", "moe/aux_loss", "moe/layer0/max_load", "moe/layer3/max_over_mean"):
            assert ep2["metrics"][key] == pytest.approx(ep1["metrics"][key], rel=GRAD_RTOL), key
        assert ep1["metrics"]["loss"] != 0.0 and ep1["metrics"]["grad_norm"] > 0.0
        assert set(ep2["grads"]) <= set(ep1["grads"])
        for name, grad in ep2["grads"].items():
            torch.testing.assert_close(grad, ep1["grads"][name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
        assert "chained optimizer" in r["refused"] and "expert_model_parallel_size" in r["refused"]
        for name, value in r["ep2_saved"].items():
            assert torch.equal(r["ep1_weights"][name], value), name
    # together the two EP=2 ranks hold every expert's gradient
    held = set(ranks[0][2]["grads"]) | set(ranks[1][2]["grads"])
    assert held == set(ranks[0][1]["grads"])
