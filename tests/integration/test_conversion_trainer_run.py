"""A run written by the trainer's checkpointing (Megatron DDP: ``module.``-prefixed keys, a
``latest`` marker over ``step_*`` directories, the run's provenance and HF config in each
checkpoint) exports to HF with no --hf-config and verifies (docs/conversion.md: run folders are accepted by
`stapo-convert mcore-to-hf` and `verify`)."""

import os

import pytest
import torch

from stapo_megatron.conversion.cli import main
from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from tests.helpers.dist_utils import run_distributed
from tests.helpers.conversion_parity import _assert_bit_exact

VARIANT = "qwen3"


def _train_and_save(hf_dir, converted, run_dir, plain_dir):
    """One rank: load the converted model, take a real STAPO-loss step on synthetic rollouts,
    save it as the trainer does (step 1), and also as a plain model-only checkpoint."""
    from stapo_megatron.mcore import checkpoint as ckpt
    from stapo_megatron.bridge import build_gpt_model, load_checkpoint
    from stapo_megatron.config import TrainerConfig
    from stapo_megatron.config.yaml_io import dump_config
    from stapo_megatron.mcore.config import ModelConfig
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel
    from stapo_megatron.runlog.provenance import RunProvenance
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import synthetic_rollouts

    prompt, response = 4, 8
    groups = init_parallel(1, 1)
    model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, calculate_per_token_loss=True)
    load_checkpoint(model, converted)
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=1e-2))
    mbs, _ = synthetic_rollouts(4, 4, prompt, response, model.module.qwen_spec.vocab_size, seed=0,
                                micro_batch_size=2)
    ctx = PassContext(model, prompt + response, groups=groups)
    old_policy_pass(ctx, [mbs])
    policy_update(ctx, optimizer, mbs, LossConfig(tau_p=0.003))
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.module.parameters()))
    # as Trainer._save: the run's configuration, provenance and HF side files go into the checkpoint
    provenance = RunProvenance(dump_config(TrainerConfig(run_dir=run_dir, model=ModelConfig(hf_dir=hf_dir))), run_dir, hf_dir)
    ckpt.save_checkpoint(run_dir, 1, model, optimizer, {"note": "test"}, write_extra=provenance.write_checkpoint)
    ckpt.save_model_only(model, plain_dir)
    # resuming reads the same files (each small one without executing code, see test_checkpoint_safety)
    state = ckpt.load_checkpoint(ckpt.find_latest(run_dir), model, optimizer)
    # a trainer checkpoint as a warm start (ModelConfig.megatron_ckpt): a bare model reads the
    # ``module.``-prefixed keys
    fresh = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32, calculate_per_token_loss=True)
    load_checkpoint(fresh, ckpt.find_latest(run_dir))
    same = all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.module.parameters()))
    destroy_parallel()
    return changed, state, same


@pytest.mark.slow
def test_trainer_run_exports_to_hf_and_verifies(tmp_path, capsys):
    hf, converted = str(tmp_path / "hf"), str(tmp_path / "converted")
    run, plain = str(tmp_path / "run"), str(tmp_path / "plain")
    save_tiny_hf_model(hf, VARIANT, dtype=torch.float32)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", converted]) == 0
    [(changed, state, warm_start_equal)] = run_distributed(1, _train_and_save, hf, converted, run, plain)
    assert warm_start_equal
    assert changed  # the step moved the weights: the export below is not the starting model
    assert state == {"note": "test", "step": 1}
    assert os.path.isfile(os.path.join(run, "checkpoints", "latest"))

    step = os.path.join(run, "checkpoints", "step_00000001")
    assert {"config.yaml", "provenance.json", "hf"} <= set(os.listdir(step))
    exported = str(tmp_path / "exported")
    # the checkpoint carries its HF config: no --hf-config; the flag still overrides
    assert main(["mcore-to-hf", "--ckpt", run, "--out", exported]) == 0
    assert main(["mcore-to-hf", "--ckpt", run, "--out", str(tmp_path / "flag_hf"), "--hf-config", hf]) == 0
    _assert_bit_exact(exported, str(tmp_path / "flag_hf"))
    # The same weights saved without DDP's prefix export to the same bytes.
    assert main(["mcore-to-hf", "--ckpt", plain, "--out", str(tmp_path / "plain_hf"), "--hf-config", hf]) == 0
    _assert_bit_exact(exported, str(tmp_path / "plain_hf"))

    capsys.readouterr()
    assert main(["verify", "--hf-dir", exported, "--ckpt", run, "--num-prompts", "2", "--seq-len", "8"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[1].split()[-1] == "yes", table
