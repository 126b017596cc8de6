"""The batch layout: how a step's sampled sequences become the micro-batches the model trains on.

- ``step_rollout``: `StepRollout`, a training step's samples as one flat record (prompt, answer,
  sample, token versions, routes per response), built once by the rollout schedule.
- ``records``: `SequenceRecord`, one sampled sequence as it travels from the rollout to the loss.
- ``microbatch``: `MicroBatch`, group advantages, padding records into label-aligned rows.
- ``packing``: packed (THD) micro-batches and token budgets balanced over data-parallel ranks.
- ``context_parallel``: the split of packed rows over context-parallel ranks (2 x CP chunks) and
  the K/V all-gather.
- ``minibatches``: `build_minibatches`, the one builder of every layout (padded, fixed, budget).
- ``alignment``: the packing modes and the multiples a sequence and a row are padded to.
"""
