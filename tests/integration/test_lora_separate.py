"""LoRA with the engines on their own ranks: the real trainer and vLLM engine over gloo, the tiny
recipe with the ``lora`` section (tests/helpers/lora_separate_script.py, which writes down every
weight transfer on both sides). Merge-on-sync under ``rollout.mode=separate`` (k = 0),
``partial`` (k = 1) and ``streaming`` (eta = 2): the engine receives, transfer for transfer, the
merged W0 + (alpha / r) B A computed apart from the sync (PEFT's per-projection adapters on the base's HF
tensors), the base stays frozen while the adapters train, and the samples drawn with fresh
weights agree with the trainer's pi_old pass within the colocated LoRA tests' tolerance.
Adapter-only sync (``rollout.engine=vllm_lora``) under ``rollout.mode`` separate and partial: the
base once, then PEFT's adapter tensors alone at each sync (the bytes benchmarks/lora_sync_bytes.py
models), the engine rank sampling with the newest adapter at k = 0."""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import HELPERS_DIR, REPO_DIR
from tests.helpers.dist_utils import free_port
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
           "--master-port", str(free_port()), SCRIPT, str(run_dir), *LORA, *overrides]
    # the script imports tests.helpers and the reward is named by dotted path: the checkout on the path
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=REPO_DIR)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def _train_rows(run_dir):
    return [r for r in compare_metrics.load_rows(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "train"]


def _transfers(run_dir):
    """(trainer rank 0's record of each sync, the engine's tensors of each transfer), in order."""
    path = os.path.join(run_dir, "transfers")
    names = sorted(os.listdir(path))
    load = lambda prefix: [torch.load(os.path.join(path, n)) for n in names if n.startswith(prefix)]  # noqa: E731
    return load("trainer_"), load("engine_")


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _modelled_bytes(run_dir) -> tuple:
    """(merged, adapter-only) bytes of one sync of the run's model at r = 4 in fp32, as
    benchmarks/lora_sync_bytes.py models them."""
    from stapo_megatron.bridge.hf_config import load_hf_config, spec_from_hf_config

    sys.path.insert(0, os.path.join(REPO_DIR, "benchmarks"))
    import lora_sync_bytes

    return lora_sync_bytes.modelled(spec_from_hf_config(load_hf_config(os.path.join(run_dir, "model"))), 4, 4)


def _assert_trained_adapters_on_a_frozen_base(records: list) -> None:
    first, last = records[0], records[-1]
    for record in records:
        assert all(torch.equal(p, first["base"][n]) for n, p in record["base"].items()), "the base is frozen"
    moved = [k for k, b in last["adapters"].items()
             if k.endswith("lora_B.weight") and not torch.equal(b, first["adapters"][k])]
    assert moved, "the adapters trained between the first and the last sync"
    # what the merge carries: adapted weights other than the base's
    assert any(not torch.equal(w, last["base_hf"][k]) for k, w in last["expected"].items())


def _assert_merged_syncs(run_dir) -> None:
    """Every transfer: the engine got the merged weights (and nothing else), as many bytes as the
    benchmark's model of a merged sync; the base never moved, the adapters did."""
    records, received = _transfers(run_dir)
    assert len(records) == len(received) > 1
    for record, got in zip(records, received):
        assert sorted(got) == sorted(record["expected"])
        for name, want in record["expected"].items():
            torch.testing.assert_close(got[name], want, rtol=MERGE_RTOL, atol=MERGE_RTOL * want.abs().max().item(),
                                       msg=name)
        assert record["bytes"] == _nbytes(got) == _modelled_bytes(run_dir)[0]
    _assert_trained_adapters_on_a_frozen_base(records)


def _assert_k0_rows(rows) -> None:
    for r in rows:  # the engine sampled with the weights the trainer has
        assert r["rollout_train_logprob_diff"] < SYNCED_ATOL and r["mismatch_abs_logprob_diff_max"] < SYNCED_ATOL, r


def test_merge_on_sync_with_separate_placement(tmp_path):
    run = _launch(tmp_path / "run", "rollout.mode=separate", "steps=3")
    assert run.returncode == 0, run.stderr[-4000:]
    rows = _train_rows(tmp_path / "run")
    assert [r["staleness"] for r in rows] == [0.0, 0.0, 0.0]
    _assert_k0_rows(rows)
    assert all(r["skipped"] == 0 and r["grad_norm"] > 0 for r in rows)
    _assert_merged_syncs(tmp_path / "run")


def test_merge_on_sync_with_streaming_rollouts(tmp_path):
    run = _launch(tmp_path / "run", "rollout.mode=streaming", "rollout.separate.max_staleness=2",
                  "loss.rollout_correction.mode=tis", "steps=3")
    assert run.returncode == 0, run.stderr[-4000:]
    rows = _train_rows(tmp_path / "run")
    # the first step's groups ran on the first sync's weights alone: fresh, k = 0
    assert rows[0]["staleness"] == 0 and rows[0]["token_age_max"] == 0
    _assert_k0_rows(rows[:1])
    assert all(r["skipped"] == 0 and r["grad_norm"] > 0 for r in rows)
    _assert_merged_syncs(tmp_path / "run")


PARTIAL = ("rollout.mode=partial", "rollout.separate.max_staleness=1", "rollout.partial.oversample=1.5",
           "rollout.partial.round_tokens=8", "loss.rollout_correction.mode=tis")
"""Partial rollouts as tests/integration/test_separate_placement.py runs them (k = 1, 8-token rounds)."""


def test_merge_on_sync_with_partial_rollouts(tmp_path):
    """Partial rollouts (k = 1) continue unfinished groups across syncs; the merged weights travel
    as with separate placement, and the first step's tokens all come from fresh weights."""
    run = _launch(tmp_path / "run", *PARTIAL, "steps=3")
    assert run.returncode == 0, run.stderr[-4000:]
    rows = _train_rows(tmp_path / "run")
    assert rows[0]["staleness"] == 0
    _assert_k0_rows(rows[:1])
    assert all(r["skipped"] == 0 and r["grad_norm"] > 0 for r in rows)
    _assert_merged_syncs(tmp_path / "run")


@pytest.mark.parametrize("mode", ["separate", "partial"])
def test_adapter_only_sync_with_separate_placement(tmp_path, mode):
    """``rollout.engine=vllm_lora``: the engine rank gets the base once (the policy with its adapters
    off), then at every sync PEFT's adapter tensors alone, as many bytes as the benchmark's model
    of an adapter-only sync, and samples with the newest adapter: k = 0 agreement every step
    (partial rollouts: the first step, the only one whose tokens all come from fresh weights)."""
    run_dir = tmp_path / "run"
    run = _launch(run_dir, "rollout.engine=vllm_lora", "steps=3",
                  *(PARTIAL if mode == "partial" else ("rollout.mode=separate",)))
    assert run.returncode == 0, run.stderr[-4000:]
    rows = _train_rows(run_dir)
    fresh = rows if mode == "separate" else rows[:1]
    assert [r["staleness"] for r in fresh] == [0.0] * len(fresh)
    _assert_k0_rows(fresh)
    assert all(r["skipped"] == 0 and r["grad_norm"] > 0 for r in rows)
    records, received = _transfers(run_dir)
    assert len(received) == len(records) + 1 > 2, "the base once, then one adapter a sync"
    base = received[0]
    assert sorted(base) == sorted(records[0]["base_hf"])
    assert all(torch.equal(t, records[0]["base_hf"][k]) for k, t in base.items())
    adapter_bytes = _modelled_bytes(run_dir)[1]
    for record, got in zip(records, received[1:]):
        assert sorted(got) == sorted(record["adapters"])
        assert all(torch.equal(t, record["adapters"][k]) for k, t in got.items())
        assert record["bytes"] == _nbytes(got) == adapter_bytes
    assert adapter_bytes < _nbytes(base) / 10  # r = 4 on the four dense linears of the tiny model
    _assert_trained_adapters_on_a_frozen_base(records)
