"""Tier a: a LoRA run's training state (`stapo_megatron.mcore.checkpoint` with adapters): Megatron's
DDP buffers and optimizer hold only the adapters, the checkpoint holds only them and resumes the
run exactly (a full fine-tune's too, with either optimizer), at a fraction of a full checkpoint's
size, and a full checkpoint is refused as LoRA (and the reverse), naming ``lora``."""

import os

import pytest
import torch

from stapo_megatron.mcore import checkpoint as ckpt
from stapo_megatron.mcore.config import OptimConfig
from stapo_megatron.mcore.lora_config import LoraConfig
from stapo_megatron.method.config import LossConfig

VOCAB, PROMPT, RESPONSE = 384, 4, 12
LORA = LoraConfig(rank=4, alpha=8.0)
MAX_SIZE_RATIO = 0.25
"""A LoRA checkpoint against a full one of the same tiny model (2 layers, hidden 64, vocabulary
384): adapters are 16 x 2 x r(4) x ~100 = ~13k of ~160k parameters, each with its two Adam
moments; the metadata and RNG files are the same in both (measured 0.117: 227 kB of 1.94 MB)."""


def _model_and_optimizer(lora, distributed: bool = False):
    """The tiny GPTModel (the same base weights on every call), with ``lora`` adapters, wrapped
    in DDP with its optimizer, as the trainer builds them."""
    from megatron.core import tensor_parallel

    from stapo_megatron.mcore.lora import apply_lora
    from stapo_megatron.mcore.step import wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import build_tiny_gpt, tiny_gpt_config

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_tiny_gpt(tiny_gpt_config(), VOCAB, PROMPT + RESPONSE)
    if lora is not None:
        apply_lora(model, lora)
    return wrap_model_and_optimizer(model, OptimConfig(lr=1e-2, use_distributed_optimizer=distributed))


def _step(model, optimizer, groups, step: int) -> float:
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update
    from stapo_megatron.recipes.synthetic import synthetic_rollouts

    mbs, _ = synthetic_rollouts(4, 4, PROMPT, RESPONSE, VOCAB, seed=step, micro_batch_size=2)
    ctx = PassContext(model, PROMPT + RESPONSE, groups=groups)
    old_policy_pass(ctx, [mbs])
    return policy_update(ctx, optimizer, mbs, LossConfig(tau_p=0.003)).metrics["loss"]


def _adapters(model):
    return {k: v.detach().clone() for k, v in model.module.named_parameters() if ".lora." in k}


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed_optimizer"])
def test_ddp_and_the_optimizer_hold_only_the_adapters(parallel, distributed):
    from stapo_megatron.mcore.lora import adapter_parameters

    model, optimizer = _model_and_optimizer(LORA, distributed)
    adapters = adapter_parameters(model.module)
    assert {id(p) for buffer in model.buffers for p in buffer.params} == {id(p) for p in adapters}
    assert len(adapters) == 16, "A and B of 2 layers x 4 linears"
    assert sum(buffer.numel_unpadded for buffer in model.buffers) == sum(p.numel() for p in adapters)
    held = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    assert held == sum(p.numel() for p in adapters), "the optimizer's parameters (or shards): A and B only"
    base = {k: v.detach().clone() for k, v in model.module.named_parameters() if ".lora." not in k}
    _step(model, optimizer, parallel, 0)
    _step(model, optimizer, parallel, 1)
    now = dict(model.module.named_parameters())
    assert all(torch.equal(v, now[k]) for k, v in base.items()), "the base stays frozen"
    assert any(v.abs().max() > 0 for k, v in _adapters(model).items() if k.endswith("lora.B")), "B moved off 0"


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed_optimizer"])
@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_the_checkpoint_resumes_exactly(parallel, tmp_path, lora, distributed):
    """LoRA: from the adapters alone. Full fine-tuning alike, for the distributed optimizer's
    shared Adam step after a load (`checkpoint_optimizer.unshare_adam_steps`), found here."""
    model, optimizer = _model_and_optimizer(lora, distributed)
    losses = [_step(model, optimizer, parallel, step) for step in range(3)]
    trained = {k: v.detach().clone() for k, v in model.module.named_parameters()}

    model, optimizer = _model_and_optimizer(lora, distributed)
    again = [_step(model, optimizer, parallel, step) for step in range(2)]
    path = ckpt.save_checkpoint(str(tmp_path / "run"), 2, model, optimizer, {"note": "lora"})
    stored = ckpt.read_dcp_metadata(path).state_dict_metadata
    model_keys = ckpt.saved_model_keys(stored)  # megatron-core 0.19's common state aside
    assert model_keys and all(".lora." in k for k in model_keys) == (lora is not None), "LoRA: adapters only"

    model, optimizer = _model_and_optimizer(lora, distributed)  # a fresh process builds the same base
    assert ckpt.load_checkpoint(path, model, optimizer)["step"] == 2
    again.append(_step(model, optimizer, parallel, 2))
    assert again == losses, "resumed: the same losses, bit for bit"
    now = dict(model.module.named_parameters())
    assert all(torch.equal(v, now[k]) for k, v in trained.items()), "and the same weights after the third update"


def test_the_adapter_checkpoint_is_a_fraction_of_the_full_one(parallel, tmp_path):
    sizes = {}
    for name, lora in (("full", None), ("lora", LORA)):
        model, optimizer = _model_and_optimizer(lora)
        _step(model, optimizer, parallel, 0)
        sizes[name] = _size(ckpt.save_checkpoint(str(tmp_path / name), 1, model, optimizer, {}))
    ratio = sizes["lora"] / sizes["full"]
    print(f"checkpoint bytes: full {sizes['full']}, LoRA {sizes['lora']} (ratio {ratio:.3f})")
    assert ratio < MAX_SIZE_RATIO


def test_full_and_lora_checkpoints_are_not_resumed_as_the_other(parallel, tmp_path):
    saved = {}
    for name, lora in (("full", None), ("lora", LORA)):
        model, optimizer = _model_and_optimizer(lora)
        saved[name] = ckpt.save_checkpoint(str(tmp_path / name), 1, model, optimizer, {})
    model, optimizer = _model_and_optimizer(LORA)
    with pytest.raises(ValueError, match=r"holds a full model .* but this run has lora set: resume it with lora=none"):
        ckpt.load_checkpoint(saved["full"], model, optimizer)
    model, optimizer = _model_and_optimizer(None)
    with pytest.raises(ValueError, match=r"holds LoRA adapters only .* but this run has lora=None"):
        ckpt.load_checkpoint(saved["lora"], model, optimizer)
