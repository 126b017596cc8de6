"""The trainer: the RL loop and the components it calls.

- ``loop``: `Trainer` (the step's phases) and `train`, the entry point.
- ``warmstart``: the supervised warm-start component and its cache.
- ``layout``: process groups from `ModelConfig` (TP, PP, CP, EP), length alignments, rollouts
  shared over context-parallel ranks.
- ``seeds``, ``preemption``, ``faults``: seeds of every random choice, the save-on-signal
  requeue, and failure records.
- ``rollout_schedule`` / ``pool_ledger`` / ``dynamic_sampling``: which policy generates which step
  and, with separate placement, the trainers' side of the engines (the engine ranks' runtime is
  the ``stapo_megatron.serve`` wing): the account of the prompts sent, dynamic sampling's refills.
- ``config``: `WarmStartConfig`.
"""
