"""The run's seeds come from one place and keep the values earlier runs used (reproducibility)."""

from stapo_megatron.serve.partial import round_seed
from stapo_megatron.trainer.seeds import Seeds
from stapo_megatron.utils import stream_seed


def test_seed_streams_keep_their_values():
    seeds = Seeds(1234)
    assert (seeds.model_init, seeds.data_split, seeds.data_order, seeds.engine()) == (1234, 1234, 1234, 1234)
    assert (seeds.warmstart_order, seeds.evaluation) == (1234 + 99, 1234 + 7)
    assert seeds.rollout(5) == stream_seed("rollout", 1234, 5) == 586627204264430560
    assert round_seed(seeds.rollout(5), 2) == stream_seed("round", 586627204264430560, 2)
    assert Seeds.microbatches(step=3, first_sequence=64, dp_rank=1) == 3 * 100_003 + 64 + 10_007
    assert Seeds.warmstart_microbatches(9) == 9


def test_streams_of_steps_and_ranks_do_not_collide():
    seeds = Seeds(0)
    rollouts = {seeds.rollout(k) for k in range(1000)}
    micro = {Seeds.microbatches(k, s, dp) for k in range(100) for s in range(0, 512, 128) for dp in range(8)}
    assert len(rollouts) == 1000 and len(micro) == 100 * 4 * 8


def test_each_dp_rank_samples_with_its_own_noise():
    seeds = Seeds(1234)
    # the engines' own RNGs: DP rank r gets seed + r (deterministic, distinct per rank)
    assert [seeds.engine(r) for r in range(4)] == [1234, 1235, 1236, 1237]
    # the per-sample seeds: rank r's prompt i, sample j is global sample (r P + i) n + j, so
    # no two samples of a step share a seed, and DP=2 draws what DP=1 draws for the same prompts
    P, n, step = 4, 8, 3  # prompts per rank, samples per prompt
    per_rank = [[seeds.rollout(step, r, P * n) + i * n + j for i in range(P) for j in range(n)] for r in range(2)]
    assert len(set(per_rank[0]) | set(per_rank[1])) == 2 * P * n
    one_rank = [seeds.rollout(step) + i * n + j for i in range(2 * P) for j in range(n)]
    assert per_rank[0] + per_rank[1] == one_rank


def test_fixed_warmstart_and_data_seeds_leave_only_rl_streams_to_the_run_seed():
    a, b = Seeds(1, warmstart_seed=1234, data_seed=1234), Seeds(2, warmstart_seed=1234, data_seed=1234)
    # what the warm-start and the held-out split depend on is shared ...
    assert (a.model_init, a.warmstart_order, a.data_split) == (b.model_init, b.warmstart_order, b.data_split)
    assert (a.model_init, a.warmstart_order, a.data_split) == (1234, 1234 + 99, 1234)
    # ... and RL's own streams follow the run's seed
    assert (a.data_order, a.rollout(0), a.evaluation) != (b.data_order, b.rollout(0), b.evaluation)


def test_hashed_streams_keep_every_sample_of_a_run_apart():
    """Step k + 1's sample i is not step k's sample i + 1 (a stream per step, not an offset),
    and a partial-rollout round's responses do not run into another replica's or round's."""
    seeds = Seeds(1234)
    m, steps = 64, 200  # samples per rank, steps
    drawn = [seeds.rollout(k, dp, m) + i for k in range(steps) for dp in range(4) for i in range(m)]
    assert len(set(drawn)) == len(drawn) == steps * 4 * m
    # round r of a pool counts its responses on from round_seed(step seed, r): up to 10,000 each
    rounds = [round_seed(seeds.rollout(k, dp, m), r) + i
              for k in range(20) for dp in range(4) for r in range(30) for i in range(0, 10_000, 97)]
    assert len(set(rounds)) == len(rounds) and not set(rounds) & set(drawn)
    # every start leaves room for a step's positions below 2^63, what torch and vLLM accept
    assert max(drawn + rounds) < 2**62 + 10**7 < 2**63
