"""LoRA with the engines on their own ranks: the real trainer and vLLM engine over gloo, the tiny
recipe with the ``lora`` section (tests/helpers/lora_separate_script.py, which writes down every
weight transfer on both sides). Merge-on-sync under ``rollout.mode=separate`` (k = 0) and
``rollout.mode=streaming`` (eta = 2): the engine receives, transfer for transfer, the merged
W0 + (alpha / r) B A computed apart from the sync (PEFT's per-projection adapters on the base's HF
tensors), the base stays frozen while the adapters train, and the samples drawn with fresh
weights agree with the trainer's pi_old pass within the colocated LoRA tests' tolerance."""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import HELPERS_DIR, REPO_DIR
from tests.helpers.dist_utils import _free_port
from tests.helpers.engine_parity import LOGPROB_ATOL
from tests.helpers.repo_scripts import compare_metrics

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(HELPERS_DIR, "lora_separate_script.py")
SYNCED_ATOL = LOGPROB_ATOL
"""Per-token |log pi_old - log pi_rollout| with synced fp32 weights, as the colocated LoRA tests
(tests/integration/test_lora_weight_sync.py, test_lora_trainer.py) derive it."""
MERGE_RTOL = torch.finfo(torch.float32).eps
"""The sync merges on Megatron's fused shard, the check on PEFT's per-projection adapters: the same
float64 sum W0 + s B A rounded once to fp32 either way, at most one ulp apart."""
LORA = ("lora.rank=4", "lora.alpha=8", "optim.lr=1e-2", "reward.name=tests.helpers.lora_models.seven_reward",
        "rollout.separate.engine_ranks=1", "eval.every=0")
"""r = 4 on the four dense linears; the lr and the reward of the colocated LoRA trainer test (mixed
rewards in every group, so that a few steps train the adapters); two trainers and one engine."""


def _launch(run_dir, *overrides: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--max-restarts", "0",
           "--master-port", str(_free_port()), SCRIPT, str(run_dir), *LORA, *overrides]
    # the script imports tests.helpers and the reward is named by dotted path: the checkout on the path
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=REPO_DIR)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def _train_rows(run_dir):
    return [r for r in compare_metrics.load_rows(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "train"]


def _transfers(run_dir) -> list:
    """[(trainer's record, engine's tensors)] per weight transfer, in order."""
    path = os.path.join(run_dir, "transfers")
    names = sorted(os.listdir(path))
    trainer = [n for n in names if n.startswith("trainer_")]
    engine = [n for n in names if n.startswith("engine_")]
    assert len(trainer) == len(engine) > 1, names
    return [(torch.load(os.path.join(path, t)), torch.load(os.path.join(path, e))) for t, e in zip(trainer, engine)]


def _assert_merged_syncs(run_dir) -> None:
    """Every transfer: the engine got the merged weights (and nothing else), the base never moved,
    the adapters did."""
    transfers = _transfers(run_dir)
    first = transfers[0][0]
    for record, got in transfers:
        assert sorted(got) == sorted(record["expected"])
        for name, want in record["expected"].items():
            torch.testing.assert_close(got[name], want, rtol=MERGE_RTOL, atol=MERGE_RTOL * want.abs().max().item(),
                                       msg=name)
        assert record["bytes"] == sum(t.numel() * t.element_size() for t in got.values())
        assert all(torch.equal(p, first["base"][n]) for n, p in record["base"].items()), "the base is frozen"
    last = transfers[-1][0]
    moved = [k for k, b in last["adapters"].items() if k.endswith("lora_B.weight") and not torch.equal(b, first["adapters"][k])]
    assert moved, "the adapters trained between the first and the last sync"
    # what the merge carries: adapted weights other than the base's
    assert any(not torch.equal(w, last["base_hf"][k]) for k, w in last["expected"].items())


def test_merge_on_sync_with_separate_placement(tmp_path):
    run = _launch(tmp_path / "run", "rollout.mode=separate", "steps=3")
    assert run.returncode == 0, run.stderr[-4000:]
    rows = _train_rows(tmp_path / "run")
    assert [r["staleness"] for r in rows] == [0.0, 0.0, 0.0]
    for r in rows:  # k = 0 every step: the engine sampled with the weights the trainer has
        assert r["rollout_train_logprob_diff"] < SYNCED_ATOL and r["mismatch_abs_logprob_diff_max"] < SYNCED_ATOL, r
        assert r["skipped"] == 0 and r["grad_norm"] > 0
    _assert_merged_syncs(tmp_path / "run")


def test_merge_on_sync_with_streaming_rollouts(tmp_path):
    run = _launch(tmp_path / "run", "rollout.mode=streaming", "rollout.separate.max_staleness=2",
                  "loss.rollout_correction.mode=tis", "steps=3")
    assert run.returncode == 0, run.stderr[-4000:]
    rows = _train_rows(tmp_path / "run")
    # the first step's groups ran on the first sync's weights alone: fresh, k = 0
    assert rows[0]["staleness"] == 0 and rows[0]["token_age_max"] == 0
    assert rows[0]["rollout_train_logprob_diff"] < SYNCED_ATOL and rows[0]["mismatch_abs_logprob_diff_max"] < SYNCED_ATOL
    assert all(r["skipped"] == 0 and r["grad_norm"] > 0 for r in rows)
    _assert_merged_syncs(tmp_path / "run")
