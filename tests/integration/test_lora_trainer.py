"""End to end: the trainer with LoRA (the ``lora`` section) on the CPU, one process, the
transformers rollout engine, a KL term: the adapters train while the base stays as it was built,
the engine samples with the merged weights (no rollout/training mismatch at k = 0), the KL
reference is the policy's base (no copy), checkpoints hold only the adapters, and a run resumed
from one continues exactly as the uninterrupted run."""

import json
import os

import pytest
import torch

from stapo_megatron.runlog.progress import WALL_CLOCK_FIELDS
from tests.helpers.dist_utils import single_process_env

pytestmark = pytest.mark.slow

SYNCED_ATOL = 1e-4
"""Per-token |log pi_old - log pi_rollout| with synced fp32 weights (tests/helpers/engine_parity.py)."""


def _config(run_dir: str, hf_dir: str, steps: int):
    from stapo_megatron.config.overrides import apply_overrides
    from stapo_megatron.recipes.tiny import tiny_demo

    cfg, _ = tiny_demo(run_dir=run_dir)
    return apply_overrides(cfg, {
        "steps": steps, "prompts_per_step": 8, "minibatch_prompts": 4, "micro_batch_size": 8, "packing": "padded",
        "save_every": 1, "eval.every": 0, "model.hf_dir": hf_dir, "data.num_train": 40, "data.num_eval": 8,
        "rollout.engine": "hf", "rollout.group_size": 4, "rollout.max_response_len": 12,
        "reward.name": "tests.helpers.lora_models.seven_reward", "reward.workers": 1,
        "loss.kl_coef": 0.05, "optim.lr": 1e-2, "lora.rank": 4, "lora.alpha": 8.0})


def _run(cfg):
    """Train ``cfg`` in this process; (its rows, the policy's parameters after it, whether the
    reference was the policy itself, the adapter versions a `VLLMLoraEngine` was sent or None)."""
    from stapo_megatron.mcore.parallel import destroy_parallel
    from stapo_megatron.trainer.loop import Trainer

    with single_process_env():
        trainer = None
        try:
            trainer = Trainer(cfg)
            rows = trainer.run()
            params = {k: v.detach().clone() for k, v in trainer.model.module.named_parameters()}
            sent = getattr(trainer.engine, "adapter_version", None)
            return rows, params, trainer.ref_model is trainer.model.module, sent
        finally:
            if trainer is not None:
                trainer.close()
            destroy_parallel()


def _values(row) -> str:
    """A metrics row without its wall-clock fields, as JSON (so that NaN equals NaN)."""
    return json.dumps({k: v for k, v in row.items() if not k.startswith("time_") and k not in WALL_CLOCK_FIELDS},
                      sort_keys=True)


def test_lora_training_syncs_merged_weights_and_resumes_exactly(tmp_path):
    from stapo_megatron.mcore import checkpoint as ckpt
    from stapo_megatron.recipes.tiny import prepare_tiny_model

    hf_dir = str(tmp_path / "model")
    prepare_tiny_model(hf_dir)
    rows, params, reference_is_policy, _ = _run(_config(str(tmp_path / "straight"), hf_dir, 3))
    assert reference_is_policy, "GRPO's reference with LoRA: the policy's base, no copy"
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["rollout_train_logprob_diff"] < SYNCED_ATOL and r["mismatch_abs_logprob_diff_max"] < SYNCED_ATOL, r
        assert r["skipped"] == 0 and r["grad_norm"] > 0
    assert any(v.abs().max() > 0 for k, v in params.items() if k.endswith("lora.B")), "the adapters trained"

    # the same run stopped after step 2 and resumed from its adapter-only checkpoint
    first, *_ = _run(_config(str(tmp_path / "resumed"), hf_dir, 2))
    latest = ckpt.find_latest(str(tmp_path / "resumed"), world_size=1)
    stored = ckpt.read_dcp_metadata(latest).state_dict_metadata
    assert all(".lora." in k for k in stored if not k.startswith("optimizer.")), "adapters only"
    rest, resumed, *_ = _run(_config(str(tmp_path / "resumed"), hf_dir, 3))
    assert [r["step"] for r in rest if r["kind"] == "train"] == [3]
    assert [_values(r) for r in first + rest if r["kind"] == "train"] == [_values(r) for r in train]
    assert all(torch.equal(resumed[k], v) for k, v in params.items()), "the same weights, base and adapters"
    assert os.path.isdir(os.path.join(str(tmp_path / "resumed"), "checkpoints", "step_00000003"))


def test_adapter_only_sync_into_vllm_in_the_trainer(tmp_path):
    """``rollout.engine="vllm_lora"``: the engine gets the base once, then each step's adapters
    alone (`stapo_megatron.rollout.vllm_lora`); the sampler agrees with the trainer at k = 0 in
    every step, also after a resume (a new engine: the base again, then the adapters)."""
    from stapo_megatron.config.overrides import apply_overrides
    from stapo_megatron.recipes.tiny import prepare_tiny_model

    pytest.importorskip("vllm")
    hf_dir = str(tmp_path / "model")
    prepare_tiny_model(hf_dir)
    run_dir = str(tmp_path / "vllm_lora")
    rows, versions = [], []
    for steps in (2, 3):
        cfg = apply_overrides(_config(run_dir, hf_dir, steps), {"rollout.engine": "vllm_lora"})
        run_rows, _, _, sent = _run(cfg)
        rows += [r for r in run_rows if r["kind"] == "train"]
        versions.append(sent)
    assert versions == [3, 2], "one adapter version at the start and one after each step"
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout_train_logprob_diff"] < SYNCED_ATOL and r["mismatch_abs_logprob_diff_max"] < SYNCED_ATOL, r
        assert r["skipped"] == 0
