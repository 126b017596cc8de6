"""What runs on an engine rank of a separately placed job: the engine's runtime beside the
trainers (their side, the rollout schedule and the pools' account, is ``trainer/``; the engine
contract and the engines themselves are ``rollout/``). It takes its own sections (`RolloutSampling`,
`ModelConfig`) and a seed, never the run's `TrainerConfig`.

- ``server``: the serve loop (`serve`, `run_engine_rank`): trainer 0's commands in order,
  weights received between requests or between decode iterations; `engine_config`, the engine
  both placements build.
- ``merged_calls``: several asking replicas' ``generate`` calls (and partial pools' rounds) as one
  engine call, each keeping its seeds.
- ``partial``: partial rollouts' `PartialPool`, one per asking replica.
- ``stream_pools`` / ``streaming``: streaming rollouts: `StreamPools` (a replica's admission queue
  shared by its engines) over the `StreamingGenerator` (one vLLM engine stepped one decode
  iteration at a time, weights loaded in flight).
- ``weight_receive``: the engine side of the bucketed weight stream.
"""
