"""The run's seeds come from one place and keep the values earlier runs used (reproducibility)."""

from stapo_megatron.seeds import Seeds


def test_seed_streams_keep_their_values():
    seeds = Seeds(1234)
    assert (seeds.model_init, seeds.data_split, seeds.data_order, seeds.engine) == (1234, 1234, 1234, 1234)
    assert (seeds.warmstart_order, seeds.evaluation) == (1234 + 99, 1234 + 7)
    assert seeds.rollout(5) == 1234 * 1_000_003 + 5
    assert Seeds.microbatches(step=3, first_sequence=64, dp_rank=1) == 3 * 100_003 + 64 + 10_007
    assert Seeds.warmstart_microbatches(9) == 9


def test_streams_of_steps_and_ranks_do_not_collide():
    seeds = Seeds(0)
    rollouts = {seeds.rollout(k) for k in range(1000)}
    micro = {Seeds.microbatches(k, s, dp) for k in range(100) for s in range(0, 512, 128) for dp in range(8)}
    assert len(rollouts) == 1000 and len(micro) == 100 * 4 * 8
