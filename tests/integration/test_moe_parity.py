"""Tier b: the tiny Qwen3-MoE on 2 gloo processes. Megatron logits from a converted checkpoint
equal transformers' at (TP, PP, EP, expert-TP) = (2, 1, 1, 2), (1, 1, 2, 1), (2, 1, 2, 1),
(1, 2, 1, 1); a checkpoint
Megatron saves at EP=2 loads at EP=1 (global expert index keys) with the same logits and
exports back to the HF weights bit-exactly.
"""

import os

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.conversion.cli import main
from stapo_megatron.conversion.verify import FP32_LOGIT_TOL, fixed_prompts, hf_logits
from tests.helpers.dist_utils import run_distributed
from tests.helpers.conversion_parity import _assert_bit_exact

VARIANT = "qwen3-moe"
LAYOUTS = [(2, 1, 1, 2), (1, 1, 2, 1), (2, 1, 2, 1), (1, 2, 1, 1)]
"""(tensor, pipeline, expert, expert-tensor) parallel sizes on 2 ranks."""


def _moe_worker(ckpt, tokens_BS, save_dir):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.conversion.verify import _megatron_forward
    from stapo_megatron.mcore.parallel import init_parallel

    def logits(model):
        model.eval()
        with torch.no_grad():
            out = _megatron_forward(model, tokens_BS)  # every stage takes part; the last has logits
        return None if out is None else out[..., : model.qwen_spec.vocab_size]

    out = {}
    for layout in LAYOUTS:
        tp, pp, ep, etp = layout
        init_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, parallel_output=False)
        out[layout + ("experts",)] = len(model.decoder.layers[0].mlp.experts.local_experts)
        load_checkpoint(model, ckpt)
        out[layout] = logits(model)
        if layout == (1, 1, 2, 1):
            # What a trainer does at EP=2: Megatron's own sharded save (each rank its 2 experts).
            if dist.get_rank() == 0:
                os.makedirs(save_dir)
            dist.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), save_dir)
        ps.destroy_model_parallel()  # the process group stays; the next layout regroups it
    # Resume the EP=2 save at EP=1 (TP=1: both ranks are data-parallel replicas with all 4 experts).
    init_parallel(1, 1)
    model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, parallel_output=False)
    load_checkpoint(model, save_dir)
    out["resumed_ep1"] = logits(model)
    out["dp"] = ps.get_data_parallel_world_size()
    return out


@pytest.mark.slow
def test_moe_logits_equal_transformers_across_tp_ep_and_reshard(tmp_path):
    hf, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    save_tiny_hf_model(hf, VARIANT, dtype=torch.float32)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    tokens_BS = fixed_prompts(tiny_config(VARIANT)["vocab_size"], num_prompts=2, seq_len=16)
    ref = hf_logits(hf, tokens_BS)
    saved = str(tmp_path / "saved_ep2" / "iter_0000001")
    results = run_distributed(2, _moe_worker, ckpt, tokens_BS, saved)
    scale = max(1.0, ref.abs().max().item())
    for rank, r in enumerate(results):
        for layout in LAYOUTS:
            assert r[layout + ("experts",)] == 4 // layout[2]
            if r[layout] is None:  # first pipeline stage: no logits
                assert layout[1] == 2 and rank == 0
                continue
            diff = (r[layout] - ref).abs().max().item()
            # Same function, different kernels and reduction orders: fp32 ulps (verify.py).
            assert diff <= FP32_LOGIT_TOL * scale, (rank, layout, diff)
            assert torch.equal(r[layout].argmax(-1), ref.argmax(-1))
        diff = (r["resumed_ep1"] - ref).abs().max().item()
        assert diff <= FP32_LOGIT_TOL * scale, (rank, "resumed at EP=1", diff)
    # The EP=2 save holds every expert at its global index: it exports to the original weights.
    assert main(["mcore-to-hf", "--ckpt", saved, "--out", back, "--hf-config", hf]) == 0
    _assert_bit_exact(hf, back)


@pytest.mark.slow
def test_verify_cli_with_expert_parallelism(tmp_path, capsys):
    hf, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    save_tiny_hf_model(hf, VARIANT)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    # 2 ranks: TP=1, DP=2, the 4 experts split over EP=2
    assert main(["verify", "--hf-dir", hf, "--ckpt", ckpt, "--ep", "2", "--num-prompts", "2", "--seq-len", "16"]) == 0
    capsys.readouterr()
    # EP must divide the expert count
    assert main(["verify", "--hf-dir", hf, "--ckpt", ckpt, "--ep", "3"]) == 2
    assert "expert_model_parallel_size 3 does not divide num_moe_experts" in capsys.readouterr().err
