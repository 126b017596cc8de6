"""Tier a: GRPO's reference policy (`stapo_megatron.mcore.reference`) without and with LoRA. With
adapters the reference is the policy's own base, the adapters off for its pass: the same
log-probs as the base model alone, bit for bit, and no second copy of the weights."""

import torch

from stapo_megatron.mcore.lora_config import LoraConfig
from tests.helpers.lora_models import full_adapter_weights

VOCAB, PROMPT, RESPONSE = 384, 4, 12


def _model(lora=None):
    """The tiny GPTModel (the same weights on every call), with ``lora`` adapters set to
    trained-size values, and its builder."""
    from megatron.core import tensor_parallel

    from stapo_megatron.mcore.lora import apply_lora
    from stapo_megatron.recipes.synthetic import build_tiny_gpt, tiny_gpt_config

    def build():
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        return build_tiny_gpt(tiny_gpt_config(), VOCAB, PROMPT + RESPONSE)

    model = build()
    if lora is not None:
        for name, adapter in apply_lora(model, lora).items():
            adapter.load_full_(*full_adapter_weights(name, adapter.full_shapes, scale_a=0.15, scale_b=0.15))
    return model, build


def _logprobs(model, groups, with_reference: bool):
    """(policy log-probs, reference log-probs or None) of fixed synthetic micro-batches."""
    from stapo_megatron.mcore.reference import add_reference_logprobs
    from stapo_megatron.mcore.schedule import PassContext, compute_logprob_entropy
    from stapo_megatron.recipes.synthetic import synthetic_rollouts

    mbs, _ = synthetic_rollouts(4, 2, PROMPT, RESPONSE, VOCAB, seed=0, micro_batch_size=4)
    ctx = PassContext(model, PROMPT + RESPONSE, groups=groups)
    policy = torch.cat([lp for lp, _ in compute_logprob_entropy(ctx, mbs)])
    if not with_reference:
        return policy, None
    add_reference_logprobs(ctx, [mbs])
    return policy, torch.cat([mb.ref_logprob for mb in mbs])


def test_no_kl_term_no_reference_and_a_full_model_gets_a_frozen_copy(parallel):
    from stapo_megatron.mcore.reference import build_reference

    model, build = _model()
    assert build_reference(model, build, kl_coef=0.0) is None
    copy = build_reference(model, build, kl_coef=0.1)
    assert copy is not model and not any(p.requires_grad for p in copy.parameters())
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), model.parameters()))


def test_the_lora_reference_is_the_base_without_a_copy(parallel):
    from stapo_megatron.mcore.lora import lora_adapters
    from stapo_megatron.mcore.reference import build_reference, reset_reference

    base, build = _model()
    model, _ = _model(LoraConfig(rank=4, alpha=8.0))
    reference = build_reference(model, build, kl_coef=0.1)
    assert reference is model, "the policy's own weights: no second copy"
    reset_reference(reference, model)  # after a warm-start: nothing to copy
    policy_lp, ref_lp = _logprobs(model, parallel, with_reference=True)
    base_lp, _ = _logprobs(base, parallel, with_reference=False)
    assert torch.equal(ref_lp, base_lp), "adapters off: the base's log-probs, bit for bit"
    assert float((policy_lp - base_lp).abs().max()) > 0.01, "the adapters change the policy"
    assert all(a.enabled for a in lora_adapters(model).values()), "the adapters back on after the pass"
    # what the reference costs: a frozen copy holds the base's bytes again, LoRA's none
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora." not in n)
    copy_bytes = sum(p.numel() * p.element_size() for p in build_reference(base, build, 0.1).parameters())
    assert copy_bytes == base_bytes > 0
