"""The tiny recipe's trainer with the transformers rollout engine (no vLLM), on one process, set up
so that STAPO's S2T mask has work in its first steps; and what the trainer test of the GPU tier
(`tests/gpu/test_trainer_s2t.py`) does with it: launch it on the CPU or on CUDA, read its step
rows, check that S2T acted and compare two runs' steps.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \\
        PYTHONPATH=. python tests/gpu/trainer_script.py RUN_DIR MODEL_DIR STEPS CACHE_DIR

Runs on CUDA when there is one (``CUDA_VISIBLE_DEVICES=`` for the CPU). A second call with more
STEPS resumes from RUN_DIR's latest checkpoint. Against the tiny recipe (`tiny_demo`):

- the reward is `digit_share`, the share of the response's characters that are digits (a
  module-level function given by its dotted path): after a 2-step warm-start the recipe's
  exact-match reward is 0 for every response, so no group has a reward spread, no token an
  advantage and S2T no candidate (the H200 run of 2026-11-27 logged ``reward 0.000 | silenced 0
  tau_H nan``); the digit share differs between almost any two responses of a barely trained
  model, so every group's advantages are non-zero;
- tau_p 0.2: such a model spreads its probability over the 100 characters, so sampled tokens are
  below it and S2T's candidates are the positive-advantage ones;
- SGD (lr 0.05): a rounding-level difference between two devices' gradients then moves the
  weights by lr times that difference (Adam's g / sqrt(v) would turn the sign of a near-zero
  gradient entry into a whole step of lr), so the comparison's bound below holds step after step;
- a 2-step warm-start cached in CACHE_DIR, which two runs share so that both start RL from the
  same weights (the first run trains and caches it); no evaluation, one reward worker, a
  checkpoint every step.

The heavy imports sit under ``__main__``: the reward pool spawns its workers, which import this
module for `digit_share`. Prints ``[phase] NAME at T s`` lines (seconds since the process started).
"""

import json
import math
import os
import subprocess
import sys
import threading
import time

START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# --- the comparison of two runs' steps (CUDA against the CPU) ---------------------------------

CHAIN = 128 + 100 + 3 * (4 * 128 + 32 + 2 * 56 + 128 + 384)
"""fp32 roundings along one log-prob of the tiny model (3 layers, hidden 128, head_dim 32, MLP
384, vocabulary 100, responses of at most 32 after prompts of at most 24 characters, "Calculate
3 + 3 + 2." and a newline: S <= 56):
the output layer's dot product (128) and the log-softmax's sum (100); per layer the two RMSNorms'
sums of squares, Q/K/V and the output projection (4 x 128), q.k (32), the softmax's sum and P.V
over the positions (2 x 56), gate/up (128) and down (384): 3,732."""
U = 2.0 ** -24
"""fp32 unit roundoff."""
STEP_RTOL = 2 * CHAIN * U
"""Relative bound on one step's metrics between two devices that start it from the same weights
and tokens: each log-prob (and entropy) is a chain of at most ``CHAIN`` fp32 roundings whose
order cuBLAS and the CPU's BLAS choose differently, so the two differ by at most gamma_CHAIN =
CHAIN u relative (Higham's bound for a chain of dot products; the typical difference is near
sqrt(CHAIN) u); a metric is a mean of such per-token values, and the gradient norm adds the
backward's chain of the same lengths: 2 CHAIN u for every metric (4.4e-4)."""


def step_rtol(step: int) -> float:
    """Step ``step`` (1-based) of two runs: each earlier update moved the two runs' weights by lr
    times gradients within ``STEP_RTOL`` of each other (SGD), which moves this step's metrics by
    at most ``STEP_RTOL`` of what that update changed them by; bounded by the metric itself, each
    earlier step adds one ``STEP_RTOL``."""
    return step * STEP_RTOL


EXACT = ("response_len_mean", "num_prompts", "silenced_count", "candidate_count", "skipped")
"""Equal on both devices: the same tokens (the HF engine's noise is drawn on the CPU), so the same
lengths (integer sums, exact in fp32); the counts, unless a token's p or H lies within
``step_rtol`` of tau_p or tau_H."""
REWARD_RTOL = 64 * U
"""The reward mean: the same 64 rewards (8 prompts x 8 samples, scored on the CPU) summed in fp32
in another order on each device, 64 u relative; one token sampled differently changes a digit
share by 1/32 of a response, 5e-4 of the mean -- far outside it."""
CLOSE = ("loss", "entropy_mean", "tau_h", "approx_kl", "clip_fraction", "grad_norm")
"""Within ``step_rtol`` relative, and absolutely within ``step_rtol`` of 1 -- the scale of a
per-token loss term (ratio ~1 times a normalised advantage), for metrics near 0 (the loss, the
first mini-batch's approx_kl)."""


def digit_share(response: str, answer: str):
    """The reward: the share of the response's characters that are digits (0 when empty)."""
    return (sum(c.isdigit() for c in response) / len(response) if response else 0.0), "ok"


def launch(run_dir, model_dir, steps: int, cache_dir: str, deadline: float, cpu: bool) -> str:
    """This script in a fresh process (one rank; ``cpu``: no GPU visible); its output, each line
    prefixed with the seconds since the launch at which it arrived. Killed at ``deadline``
    (`time.monotonic`); a failure or a kill names the exit, the phases' times and the tail."""
    from tests.helpers.dist_utils import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, os.path.abspath(__file__), str(run_dir), str(model_dir), str(steps), str(cache_dir)]
    start, lines = time.monotonic(), []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = threading.Thread(target=lambda: lines.extend(f"{time.monotonic() - start:6.1f} {line.rstrip()}"
                                                          for line in proc.stdout), daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        returncode = f"killed after {time.monotonic() - start:.0f} s (the test's time limit)"
        proc.wait()
    reader.join(timeout=10)
    out = "\n".join(lines)
    phases = [line for line in lines if "[phase]" in line or "[warm-start]" in line or " | rollout " in line
              or "resumed from" in line]
    if returncode != 0:
        raise AssertionError(f"trainer ({steps} steps, {'cpu' if cpu else 'default device'}) exit {returncode}\n"
                             "phases (s since launch):\n" + "\n".join(phases) + "\noutput tail:\n" + out[-4000:])
    return out


def train_rows(run_dir) -> list:
    """The run's training rows (``metrics.jsonl``, kind ``train``), in step order."""
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if row["kind"] == "train"]


def s2t_failures(rows: list) -> list:
    """What shows S2T did not act in these steps: no reward spread, nothing silenced, tau_H not
    finite (each step's mini-batches take tau_H from their candidates: nan when there are none)."""
    failures = []
    if sum(r["silenced_count"] for r in rows) == 0:
        failures.append("no token silenced in any step")
    for r in rows:
        if not math.isfinite(r["tau_h"]):
            failures.append(f"step {r['step']}: tau_H {r['tau_h']}")
        if not 0.0 < r["reward_mean"] < 1.0:
            failures.append(f"step {r['step']}: reward mean {r['reward_mean']} (no spread)")
    return failures


def step_differences(got: list, want: list) -> list:
    """Where run ``got``'s steps differ from ``want``'s beyond `EXACT` / `CLOSE` (``step_rtol``)."""
    failures = []
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return [f"steps {[r['step'] for r in got]} against {[r['step'] for r in want]}"]
    for g, w in zip(got, want):
        step, tol = g["step"], step_rtol(g["step"])
        for key in EXACT:
            if g[key] != w[key]:
                failures.append(f"step {step} {key}: {g[key]} against {w[key]} (different tokens sampled, or a "
                                "token within the bound of tau_p / tau_H)")
        if not abs(g["reward_mean"] - w["reward_mean"]) <= REWARD_RTOL * abs(w["reward_mean"]):
            failures.append(f"step {step} reward_mean: {g['reward_mean']!r} against {w['reward_mean']!r} (different "
                            "tokens sampled)")
        for key in CLOSE:
            if not abs(g[key] - w[key]) <= tol * max(1.0, abs(w[key])):
                failures.append(f"step {step} {key}: {g[key]!r} against {w[key]!r} (bound {tol:.1e} relative)")
    return failures


def phase(name: str) -> None:
    print(f"[phase] {name} at {time.perf_counter() - START:.1f} s", flush=True)


if __name__ == "__main__":
    import dataclasses

    import torch

    from stapo_megatron.recipes import tiny_demo
    from stapo_megatron.trainer.loop import train

    phase("imports")
    run_dir, model_dir, steps, cache_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    print(f"device {'cuda' if torch.cuda.is_available() else 'cpu'}", flush=True)
    cfg, warmstart = tiny_demo(run_dir=run_dir)
    cfg = dataclasses.replace(
        cfg, steps=steps, prompts_per_step=8, minibatch_prompts=4, micro_batch_size=16,
        eval=dataclasses.replace(cfg.eval, every=0), save_every=1,
        model=dataclasses.replace(cfg.model, hf_dir=model_dir),
        data=dataclasses.replace(cfg.data, num_train=100, num_eval=10),
        rollout=dataclasses.replace(cfg.rollout, engine="hf"),
        reward=dataclasses.replace(cfg.reward, name="tests.gpu.trainer_script.digit_share", workers=1),
        loss=dataclasses.replace(cfg.loss, tau_p=0.2),
        optim=dataclasses.replace(cfg.optim, optimizer="sgd", lr=0.05),
    )
    train(cfg, dataclasses.replace(warmstart, steps=2, cache_dir=cache_dir))
    phase("done")
