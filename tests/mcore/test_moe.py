"""Tier a: MoE training pieces on one process. The load-balancing aux loss reaches the gradients
with weight exactly c (coefficient x grad of the aux loss), whatever the STAPO normaliser counts;
megatron-core's own weight would be c x (routed tokens / normaliser). Expert-load metrics."""

import pytest
import torch

from stapo_megatron.bridge import build_gpt_model
from stapo_megatron.bridge.tiny import tiny_config
from stapo_megatron.mcore.moe import MoEStepMonitor, routers
from stapo_megatron.mcore.step import wrap_ddp

COEFF = 0.1
B, S = 2, 12


def _model(coeff=COEFF, **overrides):
    torch.manual_seed(0)
    return build_gpt_model(tiny_config("qwen3-moe"), params_dtype=torch.float32, calculate_per_token_loss=True,
                           moe_aux_loss_coeff=coeff, **overrides)


def _aux_grads(model, tokens):
    """c x grad of the sum over layers of megatron-core's switch loss, computed here from the
    routers' inputs (autograd through the router weight and everything upstream)."""
    aux = []

    def hook(router, inputs, output):
        hidden = inputs[0].reshape(-1, inputs[0].shape[-1])
        probs_TE = torch.softmax(hidden @ router.weight.t(), -1)
        tokens_E = output[1].sum(0).float()
        T, E = output[1].shape
        aux.append(E * (probs_TE.sum(0) * tokens_E).sum() / (T * T * router.topk))

    handles = [r.register_forward_hook(hook) for r in routers(model)]
    model.zero_grad()
    model(tokens, torch.arange(S)[None].expand(B, S), attention_mask=None)
    for h in handles:
        h.remove()
    (COEFF * sum(aux)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step_grads(ddp, tokens, normaliser, fix=True):
    """Megatron's schedule over one micro-batch whose STAPO loss is zeroed (normaliser n)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    monitor = MoEStepMonitor(ddp)

    def loss_fn(logits):
        return 0.0 * logits.sum(), torch.tensor(normaliser, dtype=torch.int), {}

    def forward_step(data_iterator, model):
        tok = next(data_iterator)
        out = model(tok, torch.arange(S)[None].expand(B, S), attention_mask=None)
        return out, monitor.scaled_loss(loss_fn) if fix else loss_fn

    ddp.zero_grad_buffer()
    with monitor:
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=ddp,
                                    num_microbatches=1, seq_length=S, micro_batch_size=B)
    grads = {n.removeprefix("module."): p.main_grad.clone() for n, p in ddp.named_parameters()}
    return grads, monitor


def test_aux_loss_weight_is_coefficient_whatever_the_normaliser(parallel):
    tokens = torch.randint(0, 300, (B, S), generator=torch.Generator().manual_seed(1))
    ref_model = _model(coeff=0.0)  # same weights; megatron-core attaches no aux loss of its own
    want = _aux_grads(ref_model, tokens)
    ddp = wrap_ddp(_model())
    assert any(n.endswith("router.weight") for n in want) and any("linear_qkv" in n for n in want)
    for normaliser in (3, 17):  # e.g. kept tokens of two different STAPO masks
        got, monitor = _step_grads(ddp, tokens, normaliser)
        for name, g in want.items():
            # same fp32 function, Megatron's autograd vs this test's: a few ulps
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-8, msg=name)
    # megatron-core's own weight (no fix): c x (B x S routed tokens) / normaliser
    got, _ = _step_grads(ddp, tokens, 3, fix=False)
    name = "decoder.layers.0.mlp.router.weight"
    torch.testing.assert_close(got[name], want[name] * (B * S) / 3, rtol=1e-5, atol=1e-8)


def test_expert_load_metrics(parallel):
    tokens = torch.randint(0, 300, (B, S), generator=torch.Generator().manual_seed(2))
    ddp = wrap_ddp(_model())
    _, monitor = _step_grads(ddp, tokens, 5)
    m = monitor.metrics()
    k, E = 2, 4
    for layer in range(4):
        # every token goes to top-k experts: mean load is tokens x k / E
        assert m[f"moe/layer{layer}/mean_load"] == pytest.approx(B * S * k / E)
        assert B * S * k / E <= m[f"moe/layer{layer}/max_load"] <= B * S
        assert m[f"moe/layer{layer}/aux_loss"] >= 1.0 - 1e-6  # switch loss >= 1, 1 when balanced
    assert m["moe/aux_loss"] == pytest.approx(sum(m[f"moe/layer{i}/aux_loss"] for i in range(4)))


def test_expert_load_metrics_count_a_recomputed_microbatch_once(parallel):
    """Full activation recomputation reruns every router in backward; the loads, the aux loss and
    the aux-loss weight must be those of one forward (they were doubled before the fix)."""
    tokens = torch.randint(0, 300, (B, S), generator=torch.Generator().manual_seed(3))
    plain_grads, plain = _step_grads(wrap_ddp(_model()), tokens, 5)
    recompute = wrap_ddp(_model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    calls = []
    handles = [r.register_forward_hook(lambda *a: calls.append(1)) for r in routers(recompute)]
    grads, monitor = _step_grads(recompute, tokens, 5)
    for h in handles:
        h.remove()
    assert len(calls) == 2 * len(routers(recompute))  # the routers did run twice: the check can fail
    got, want = monitor.metrics(), plain.metrics()
    assert got.keys() == want.keys()
    for key in want:
        # the same fp32 forward: the recomputed pass reproduces it bit for bit on the CPU
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    for name, g in plain_grads.items():
        # recomputation changes no gradient, the aux-loss weight included (same fp32 ops)
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-8, msg=name)
