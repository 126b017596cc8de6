"""One vLLM engine of the rollout-schedule simulator, shared by every schedule (`sim_schedules.py`,
`sim_streaming.py`): `stapo_megatron.recipes.step_engine.Engine` (continuous batching, admission
while the KV cache holds a sequence and every running one's next token, recompute preemption of
the newest running sequence, the version of every token, in-flight or drained weight loads), the
one the dry run's step estimate runs too; see that module.
"""

from stapo_megatron.recipes.step_engine import Engine, Seq  # noqa: F401
