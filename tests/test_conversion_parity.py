"""Tier b: Megatron logits from converted checkpoints equal transformers logits (fp32) at
(TP, PP) = (1,1), (2,1), (1,2), (2,2); checkpoints saved by Megatron itself export back bit-exactly.

One group of 4 gloo processes serves every layout and every model variant (spare ranks are
data-parallel replicas taking a share of the prompts), so the tier costs one spawn.
"""

import os

import pytest
import torch

from stapo_megatron.conversion.cli import main
from stapo_megatron.conversion.verify import FP32_LOGIT_TOL, compare, fixed_prompts, format_table, hf_logits
from stapo_megatron.bridge import spec_from_hf_config
from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from tests.dist_utils import run_distributed
from tests.test_conversion_roundtrip import _assert_bit_exact

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
VARIANTS = ["qwen2", "qwen2.5", "qwen3", "qwen3-tied"]
SAVED_BY_MEGATRON = ("qwen3", "qwen2.5")  # untied and tied: re-saved by Megatron at TP=2 PP=2


def _parity_worker(jobs, tokens_BS, save_root):
    """Every layout x every variant on this rank; returns logits shares and a few facts."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from stapo_megatron.conversion.verify import _megatron_forward
    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.mcore.parallel import init_parallel

    out = {"logits": {}, "keys": {}, "inv_freq": {}, "plain_load_equal": {}}
    for tp, pp in LAYOUTS:
        init_parallel(tp, pp)
        for variant, ckpt in jobs:
            model = build_gpt_model(tiny_config(variant), params_dtype=torch.float32, parallel_output=False)
            load_checkpoint(model, ckpt)
            model.eval()
            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            ids = list(range(dp_rank, tokens_BS.shape[0], dp))
            with torch.no_grad():
                logits = _megatron_forward(model, tokens_BS[ids])
            if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                out["logits"][(variant, tp, pp)] = (ids, logits[..., : model.qwen_spec.vocab_size])
            if (tp, pp) == (2, 1):
                # Megatron's own loader (no bridge helper, strict) reads the same weights.
                plain = build_gpt_model(tiny_config(variant), params_dtype=torch.float32)
                plain.load_state_dict(dist_checkpointing.load(plain.sharded_state_dict(), ckpt), strict=True)
                out["plain_load_equal"][(variant, dist.get_rank())] = all(
                    torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
            if (tp, pp) == (1, 1) and dist.get_rank() == 0:
                sharded = model.sharded_state_dict()
                apply_factories(sharded)  # linear_fc1's SwiGLU factory -> its ShardedTensors
                out["keys"][variant] = {
                    v.key: tuple(v.global_shape) for v in nested_values(sharded) if isinstance(v, ShardedTensor)
                }
                out["inv_freq"][variant] = model.rotary_pos_emb.inv_freq.clone()
            if (tp, pp) == (2, 2) and variant in SAVED_BY_MEGATRON:
                # What a trainer does: Megatron's own sharded save of the model (4 ranks).
                path = os.path.join(save_root, variant, "iter_0000003")
                if dist.get_rank() == 0:
                    os.makedirs(path)
                dist.barrier()
                dist_checkpointing.save(model.sharded_state_dict(), path)
            del model
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """fp32 tiny HF models of each variant and their converted checkpoints."""
    root = tmp_path_factory.mktemp("parity")
    jobs = []
    for variant in VARIANTS:
        hf, ckpt = str(root / variant / "hf"), str(root / variant / "ckpt")
        save_tiny_hf_model(hf, variant, dtype=torch.float32)
        assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
        jobs.append((variant, hf, ckpt))
    return root, jobs


@pytest.fixture(scope="module")
def megatron_run(converted):
    root, jobs = converted
    tokens_BS = fixed_prompts(300, num_prompts=4, seq_len=24)
    results = run_distributed(4, _parity_worker, [(v, c) for v, _, c in jobs], tokens_BS, str(root / "saved"))
    merged = {"logits": {}, "keys": {}, "inv_freq": {}, "plain_load_equal": {}}
    for r in results:
        merged["plain_load_equal"].update(r["plain_load_equal"])
        merged["keys"].update(r["keys"])
        merged["inv_freq"].update(r["inv_freq"])
        for key, (ids, logits) in r["logits"].items():
            merged["logits"].setdefault(key, {}).update(zip(ids, logits))
    return tokens_BS, merged


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_logit_parity_all_layouts(converted, megatron_run, variant):
    _, jobs = converted
    hf = next(h for v, h, _ in jobs if v == variant)
    tokens_BS, run = megatron_run
    ref_BSV = hf_logits(hf, tokens_BS)
    assert ref_BSV.abs().max() > 1.0  # logits are O(1), so top-1 agreement means something
    rows = []
    for tp, pp in LAYOUTS:
        shares = run["logits"][(variant, tp, pp)]
        got_BSV = torch.stack([shares[i] for i in range(tokens_BS.shape[0])])
        rows.append(compare(ref_BSV, got_BSV, tp, pp))
    print(f"\n{variant}\n{format_table(rows)}")
    for row in rows:
        assert row.max_abs_diff <= FP32_LOGIT_TOL * row.logit_scale, row
        assert row.top1_agreement == 1.0, row


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_converter_writes_exactly_megatrons_keys_and_shapes(converted, megatron_run, variant):
    from stapo_megatron.conversion.dcp_io import CheckpointReader

    _, jobs = converted
    ckpt = next(c for v, _, c in jobs if v == variant)
    stored = {k: tuple(md.size) for k, md in CheckpointReader(ckpt).tensors().items()}
    assert stored == megatron_run[1]["keys"][variant]


@pytest.mark.slow
def test_plain_megatron_load_matches_bridge_load(megatron_run):
    equal = megatron_run[1]["plain_load_equal"]
    assert len(equal) == len(VARIANTS) * 4 and all(equal.values())


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_rotary_base_reaches_the_model(megatron_run, variant):
    spec = spec_from_hf_config(tiny_config(variant))
    d = spec.kv_channels
    expected = 1.0 / (spec.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    torch.testing.assert_close(megatron_run[1]["inv_freq"][variant].cpu(), expected, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("variant", SAVED_BY_MEGATRON)
def test_megatron_saved_training_checkpoint_exports_bit_exact(converted, megatron_run, tmp_path, variant):
    root, jobs = converted
    hf = next(h for v, h, _ in jobs if v == variant)
    run_dir = root / "saved" / variant
    (run_dir / "latest_checkpointed_iteration.txt").write_text("3")
    back = str(tmp_path / "back")
    assert main(["mcore-to-hf", "--ckpt", str(run_dir), "--out", back, "--hf-config", hf]) == 0
    _assert_bit_exact(hf, back)


@pytest.mark.slow
def test_verify_cli(converted, capsys):
    _, jobs = converted
    _, hf, ckpt = jobs[2]  # qwen3 untied
    assert main(["verify", "--hf-dir", hf, "--ckpt", ckpt, "--tp", "2", "--pp", "1"]) == 0
    table = capsys.readouterr().out
    assert "100.0%" in table and "yes" in table
    # A checkpoint of a different model (same shapes, other weights) must fail with exit code 1.
    other_hf, other_ckpt = hf + "-reseeded", ckpt + "-reseeded"
    save_tiny_hf_model(other_hf, "qwen3", dtype=torch.float32, seed=1)
    assert main(["hf-to-mcore", "--hf-dir", other_hf, "--out", other_ckpt]) == 0
    assert main(["verify", "--hf-dir", hf, "--ckpt", other_ckpt]) == 1
    assert "NO" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (transformer-engine layer spec)")
def test_te_spec_loads_the_same_checkpoint(converted):
    pytest.importorskip("transformer_engine")
    from stapo_megatron.conversion.verify import megatron_logits

    _, jobs = converted
    _, hf, ckpt = jobs[2]
    tokens_BS = fixed_prompts(300)
    # On a CUDA machine build_gpt_model picks the transformer-engine spec automatically.
    got = megatron_logits(ckpt, tiny_config("qwen3"), [(1, 1)], tokens_BS)[(1, 1)]
    row = compare(hf_logits(hf, tokens_BS), got, 1, 1)
    assert row.top1_agreement == 1.0 and row.max_abs_diff < 1e-3, row
