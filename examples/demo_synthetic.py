"""Demo: real STAPO optimisation steps of a tiny Megatron GPTModel on synthetic rollouts.

Run (2 processes, TP=2 over gloo on a CPU machine; `make demo` runs the RL loop instead,
`launch/stapo_tiny.py`):

    .venv/bin/torchrun --nproc-per-node 2 examples/demo_synthetic.py

Each step samples synthetic rollouts (random tokens, Bernoulli rewards, group advantages),
computes pi_old log-probs and entropies with the Megatron model, and runs PPO mini-batches through
Megatron's forward_backward_func with the STAPO loss and the Megatron optimizer. It prints the
loss, response entropy, tau_H and the number of tokens S2T silenced per mini-batch: the loss and
Megatron plumbing alone, without rollouts or rewards.
"""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from stapo_megatron.method.config import LossConfig
from stapo_megatron.mcore.config import OptimConfig
from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel
from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
from stapo_megatron.recipes.synthetic import build_tiny_gpt, synthetic_rollouts, tiny_gpt_config


@dataclasses.dataclass
class DemoConfig:
    """Sizes of the synthetic demo (small enough for a 2-core CPU in about a minute)."""

    steps: int = 8
    """Training steps (rollout batches)."""
    prompts_per_step: int = 8
    """Prompts per step (the paper: 256)."""
    group_size: int = 8
    """Responses per prompt, G (the paper: 8)."""
    minibatches_per_step: int = 2
    """PPO mini-batches per step (the paper: 256 / 64 = 4)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch."""
    prompt_len: int = 16
    """Prompt tokens."""
    response_len: int = 48
    """Maximum response tokens."""
    vocab_size: int = 384
    """Vocabulary of the tiny model. Its near-uniform initial policy gives p ~ 1/V ~ 0.0026 to
    the random synthetic tokens, so with the paper's tau_p = 0.002 only the tail is a candidate."""
    tensor_model_parallel_size: int = 2
    """TP size (world size must be a multiple)."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy loss (paper defaults: STAPO, tau_p 0.002, q 0.75, clip 0.2/0.28)."""
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-3))
    """AdamW (a larger lr than the paper's 1e-6 so that a few steps visibly move the model)."""


def main(cfg: DemoConfig) -> None:
    groups = init_parallel(cfg.tensor_model_parallel_size, 1)
    rank = dist.get_rank()
    dp_size, dp_rank = dist.get_world_size(groups.dp), dist.get_rank(groups.dp)
    seq_len = cfg.prompt_len + cfg.response_len
    model = build_tiny_gpt(tiny_gpt_config(cfg.tensor_model_parallel_size), cfg.vocab_size, seq_len)
    model, optimizer = wrap_model_and_optimizer(model, cfg.optim)
    if rank == 0:
        print(f"tiny GPTModel TP={cfg.tensor_model_parallel_size} DP={dp_size}, method={cfg.loss.method}, "
              f"tau_p={cfg.loss.tau_p}, q={cfg.loss.entropy_quantile}", flush=True)
        print(f"{'step':>4} {'mb':>2} {'reward':>6} {'loss':>9} {'entropy':>7} {'tau_H':>6} "
              f"{'silenced':>8} {'kept':>5} {'clip':>5} {'sec':>5}", flush=True)
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        mbs, stats = synthetic_rollouts(
            cfg.prompts_per_step, cfg.group_size, cfg.prompt_len, cfg.response_len,
            cfg.vocab_size, seed=1000 * step + 7, micro_batch_size=cfg.micro_batch_size,
        )
        mbs = mbs[dp_rank::dp_size]
        per_mini = len(mbs) // cfg.minibatches_per_step
        minis = [mbs[i * per_mini : (i + 1) * per_mini] for i in range(cfg.minibatches_per_step)]
        ctx = PassContext(model, seq_len, cfg.loss.temperature, groups)
        old_policy_pass(ctx, minis)
        for i, mini in enumerate(minis):
            m = policy_update(ctx, optimizer, mini, cfg.loss).metrics
            if rank == 0:
                print(f"{step:>4} {i:>2} {stats['reward_mean']:>6.2f} {m['loss']:>9.5f} "
                      f"{m['entropy_mean']:>7.3f} {m['tau_h']:>6.3f} {m['silenced_count']:>8d} "
                      f"{m['num_kept']:>5d} {m['clip_fraction']:>5.3f} {time.perf_counter() - t0:>5.1f}",
                      flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main(DemoConfig())
