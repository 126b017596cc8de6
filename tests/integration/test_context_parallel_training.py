"""Context parallelism on gloo (tier b): the all-gather CP attention, whole training updates at CP=2
and TP=2 x CP=2 against CP=1 on the same data, checkpoints across CP sizes, the trainer at CP=2,
and the in-training evaluation spread over CP against CP=1 (exact: same samples, integer counts).
The single-process tests are in ``tests/batch/test_context_parallel.py``; the workers, and the
tolerances with their reasons, in ``tests/helpers/context_parallel_workers.py``."""

import dataclasses
import os
import pytest
import torch
import torch.distributed as dist
from stapo_megatron.batch.alignment import sequence_multiple
from stapo_megatron.batch.context_parallel import local_positions, split_for_context_parallel, unsplit
from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
from stapo_megatron.batch.packing import pack_thd
from stapo_megatron.batch.records import record, records_from_lists
from tests.helpers.dist_utils import run_distributed
from tests.helpers.context_parallel_workers import ATTN_ATOL, EVAL_K, LOGGED, SET_K, _attention_worker, _check_same, _checkpoint_worker, _eval_worker, _rollouts, _silenced, _train_worker  # noqa: F401
from tests.helpers import TESTS_DIR, HELPERS_DIR


@pytest.mark.slow
def test_cp_attention_equals_causal_attention():
    for result in run_distributed(2, _attention_worker, 2):
        got, want = result["out"]
        assert want.abs().max() > 0.5
        torch.testing.assert_close(got, want, atol=ATTN_ATOL, rtol=0)
        for name, (g, w) in zip("qkv", result["grads"]):
            torch.testing.assert_close(g, w, atol=ATTN_ATOL, rtol=0, msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_cp2_trains_as_cp1(tp):
    """World 2 x tp: CP=1 (DP=2) then CP=2 (DP=1) in the same processes on the same mini-batch.
    CP=2's budget per rank (24 tokens) is below the longest sequence (32 tokens), which trains
    because CP splits it; CP=1 packs up to 48 tokens per micro-batch."""
    prompts, responses, _, _ = _rollouts()
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    assert longest > 24
    results = run_distributed(2 * tp, _train_worker, tp, (1, 2), (48, 24))
    assert max(res[2]["tokens"] for res in results) <= 24
    _check_same(results, 2)


@pytest.mark.slow
def test_cp2_grpo_with_seq_mask_trains_as_cp1():
    """GRPO (sequence mean, k3 KL 0.04 to a reference model) with the seq_mask correction: CP=2
    splits every sequence, so |o_i|, the sequence count and each sequence's geometric-mean ratio
    need the CP group; the same loss (sum over sequences of their token means / sequence count),
    rejected tokens, metrics and weights as CP=1 (`_check_same`'s tolerances, same reason)."""
    results = run_distributed(2, _train_worker, 1, (1, 2), (48, 24), "grpo_seq_mask")
    _check_same(results, 2, silencing=False)
    first = results[0][1]["history"][0]
    # some sequences rejected, some trained; the reference differs from the policy (KL acts)
    assert 0 < first["correction_rejected_count"] < first["num_response_tokens"]
    assert first["num_kept"] > 0 and results[0][1]["ref_gap"] > 0.1
    assert results[0][1]["history"][1]["clip_fraction"] > 0, "the second update must be off-policy and clip"


@pytest.mark.slow
def test_cp2_s2t_on_gspo_trains_as_cp1():
    """S2T on GSPO (loss.objective=gspo): every sequence's geometric-mean ratio and |o_i| are
    summed over the CP group, so CP=2 silences the same tokens and trains the same weights as
    CP=1 (`_check_same`'s tolerances)."""
    results = run_distributed(2, _train_worker, 1, (1, 2), (48, 24), "stapo_gspo")
    _check_same(results, 2, silencing=False)
    silenced = [(_silenced(results, 2, u), _silenced(results, 1, u)) for u in range(2)]
    for got, want in silenced:
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sum(len(want) for _, want in silenced) > 0, "the S2T mask must be exercised"


@pytest.mark.slow
def test_checkpoint_cp2_resumes_at_cp1_and_back_and_exports(tmp_path):
    """A checkpoint saved at CP=2 loads at CP=1 (weights bit-equal) and the next update there
    equals CP=2's own next update (Adam moments restored; 2e-6 absolute at lr 1e-3, 0.2% of a
    step: reduction order, as above, which Adam amplifies where |g| is near eps, the embedding
    rows of rare tokens: 1.1e-6 measured since the op's torch path computes each chunk with
    torch.softmax, 2026-11-26); CP=1's save loads at CP=2 bit-equal; the CP-trained run exports
    to HF (`stapo-convert mcore-to-hf`) with the weights it trained."""
    from safetensors.torch import load_file

    from stapo_megatron.bridge.tiny import save_tiny_hf_model
    from stapo_megatron.conversion.cli import main

    hf, run_cp2, run_cp1 = str(tmp_path / "hf"), str(tmp_path / "cp2"), str(tmp_path / "cp1")
    save_tiny_hf_model(hf, "qwen3", dtype=torch.float32)
    results = run_distributed(2, _checkpoint_worker, hf, run_cp2, run_cp1)
    for res in results:
        assert res["state"] == {"layout": "cp2", "step": 1}
        for name, want in res["saved_cp2"].items():
            assert torch.equal(res["loaded_cp1"][name], want), name
            torch.testing.assert_close(res["next_cp1"][name], res["next_cp2"][name], atol=2e-6, rtol=0, msg=name)
            assert torch.equal(res["loaded_cp2"][name], res["next_cp1"][name]), name
        assert all(not torch.equal(res["next_cp2"][n], w) for n, w in res["saved_cp2"].items()), "the update moves"
        assert res["loss_cp1"] == pytest.approx(res["loss_cp2"], rel=2e-5)
    exported = str(tmp_path / "exported")
    assert main(["mcore-to-hf", "--ckpt", run_cp2, "--out", exported, "--hf-config", hf]) == 0
    tensors = {}
    for name in os.listdir(exported):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(exported, name)))
    saved = results[0]["saved_cp2"]
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    assert torch.equal(tensors["model.embed_tokens.weight"], saved["embedding.word_embeddings.weight"][:vocab])
    assert torch.equal(tensors["model.layers.0.mlp.down_proj.weight"],
                       saved["decoder.layers.0.mlp.linear_fc2.weight"])


@pytest.mark.slow
def test_trainer_runs_at_cp2(tmp_path):
    """The real trainer at CP=2 (2 processes): layout, rollouts shared over CP, the split
    micro-batches, the warm-start on packed rows, a checkpoint per step. The HF engine samples
    with the weights Megatron trains (fp32 both), so the rollout/training log-prob mismatch,
    computed from the CP-split pi_old pass, is at rounding level."""
    import json
    import subprocess
    import sys

    from stapo_megatron.mcore import checkpoint as ckpt
    from tests.helpers.dist_utils import free_port

    here = TESTS_DIR
    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    subprocess.run([sys.executable, os.path.join(here, "..", "examples", "prepare_tiny_model.py"), str(model_dir)],
                   check=True, capture_output=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           os.path.join(HELPERS_DIR, "cp_trainer_script.py"), str(run_dir), str(model_dir), "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["skipped"] == 0 and r["num_prompts"] == 8 and r["response_len_mean"] > 0
        assert r["rollout_train_logprob_diff"] < 1e-4
        assert r["mismatch_seq_flagged_fraction"] == 0.0  # sequence statistics from whole, gathered sequences
    assert ckpt.find_latest(str(run_dir), world_size=2).endswith("step_00000002")


@pytest.mark.slow
def test_evaluation_is_spread_over_cp_and_equals_cp1(tmp_path):
    """CP=2 evaluation: each CP rank samples its own share of the problems (5 held-out problems
    split 2 + 3, 3 named-set problems 1 + 2 per decoding), every problem counts exactly once,
    and the row and the logged samples equal CP=1's exactly (the same per-problem seeds, one
    sequence per forward; the counts are integer sums)."""
    import json

    from stapo_megatron.recipes.tiny import prepare_tiny_model

    model_dir = str(tmp_path / "model")
    prepare_tiny_model(model_dir)
    held_out, bench = tmp_path / "held_out.jsonl", tmp_path / "bench.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n"
                                for a in range(1, 6)))
    bench.write_text("".join(json.dumps({"problem": f"Add {a} and 1.", "answer": str(a + 1)}) + "\n"
                             for a in range(3)))
    run_dirs = {name: str(tmp_path / name) for name in ("cp2", "cp1")}
    results = run_distributed(2, _eval_worker, model_dir, str(held_out), str(bench), run_dirs)
    decodings = ("T1.0_p1.0", "T0.7_p0.9")
    # the engines' shares: held-out 2 + 3 problems, then each decoding's 1 + 2
    assert [r["cp2_asked"] for r in results] == [2 + 2 * 1, 3 + 2 * 2]
    assert all(r["cp1_asked"] == 5 + 2 * 3 for r in results)  # each one-rank run samples everything
    for r in results:
        cp2 = {k: v for k, v in r["cp2"].items() if k != "time_eval"}
        assert cp2 == {k: v for k, v in r["cp1"].items() if k != "time_eval"}
        assert cp2["eval_num"] == 5 * EVAL_K  # each held-out problem counted once
        assert 0 < cp2["eval_accuracy"] < 1, "the parity reward must score some samples and not others"
        for d in decodings:
            assert 0 <= cp2[f"eval/bench/{d}/avg@{SET_K}"] <= cp2[f"eval/bench/{d}/pass@{SET_K}"] <= 1
    logged = results[0]["cp2_logged"]
    assert len(logged) == 1 and len(logged[0]["samples"]) == LOGGED > 2 * EVAL_K  # rank 0's share has 6
    assert logged == results[0]["cp1_logged"]
