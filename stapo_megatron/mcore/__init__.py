"""Training on Megatron-Core: everything that runs the policy model (named for Megatron-Core, so
that it is not confused with ``trainer/``, the RL loop that calls it). The micro-batches it trains
on are laid out in ``batch/``, the log-prob/entropy op is ``ops/``.

- ``schedule``: the one micro-batch runner on Megatron's schedules; `PassContext`; the no-grad
  log-prob pass and `old_policy_pass`, which fills each micro-batch's pi_old log-probs.
- ``loss`` / ``loss_metrics``: the STAPO loss in Megatron's schedule and its reduced metrics (the
  log-prob/entropy op and the logit-gradient norm they use are the ``stapo_megatron.ops`` wing).
- ``step``: DDP, the optimizer and one policy update (threshold, forward/backward, step).
- ``reference``: GRPO's frozen reference model; ``sft``: the supervised warm-start step.
- ``parallel``, ``checkpoint`` (+ ``checkpoint_optimizer``), ``cpu_compat``: process groups, checkpoints
  and their optimizer state, CPU shims.
- ``mcore_versions``: what differs between megatron-core releases (explicit version checks).
- ``config``: `ModelConfig` (which model, at which layout) and `OptimConfig`.
- ``lora`` / ``lora_config``: LoRA adapters on the parallel linears, placed as the base is sharded
  (a library component: the RL loop does not use it yet), and `LoraConfig`.
"""
