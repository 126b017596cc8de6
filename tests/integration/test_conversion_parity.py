"""Tier b: Megatron logits from converted checkpoints equal transformers logits (fp32) at: the
multi-process and end-to-end tests (the single-process ones are in
``tests/conversion/test_verify.py``)."""

import os
import pytest
import torch
from stapo_megatron.conversion.cli import main
from stapo_megatron.conversion.verify import FP32_LOGIT_TOL, compare, fixed_prompts, format_table, hf_logits
from stapo_megatron.bridge import spec_from_hf_config
from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from tests.helpers.dist_utils import run_distributed
from tests.helpers.conversion_parity import (LAYOUTS, SAVED_BY_MEGATRON, VARIANTS, _assert_bit_exact,  # noqa: F401
                                             converted, megatron_run)


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
