"""Training on Megatron-Core: everything that runs the policy model (named for Megatron-Core, so
that it is not confused with ``trainer/``, the RL loop that calls it).

- ``records``: `SequenceRecord`, one sampled sequence as it travels from the rollout to the loss.
- ``minibatches``: `build_minibatches`, the one builder of every layout (padded, fixed, budget).
- ``batching``: `MicroBatch`, group advantages, packing rollouts into label-aligned micro-batches.
- ``packing`` / ``context_parallel``: packed (THD) micro-batches and token budgets; the split of
  packed rows over context-parallel ranks (2 x CP chunks) and the K/V all-gather.
- ``schedule``: the one micro-batch runner on Megatron's schedules; `PassContext`; the no-grad
  log-prob pass and `old_policy_pass`, which fills each micro-batch's pi_old log-probs.
- ``loss`` / ``loss_metrics``: the STAPO loss in Megatron's schedule and its reduced metrics (the
  log-prob/entropy op and the logit-gradient norm they use are the ``stapo_megatron.ops`` wing).
- ``step``: DDP, the optimizer and one policy update (threshold, forward/backward, step).
- ``reference``: GRPO's frozen reference model; ``sft``: the supervised warm-start step.
- ``parallel``, ``checkpoint`` (+ ``checkpoint_optimizer``), ``cpu_compat``: process groups, checkpoints
  and their optimizer state, CPU shims.
- ``mcore_versions``: what differs between megatron-core releases (explicit version checks).
- ``synthetic``: a tiny GPTModel (from `bridge.tiny`'s spec) and synthetic rollouts for the demo,
  benchmarks and tests.
- ``config``: `ModelConfig` (which model, at which layout) and `OptimConfig`.
"""
