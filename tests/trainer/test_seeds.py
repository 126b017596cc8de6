"""The run's seeds come from one place and keep the values earlier runs used (reproducibility)."""

from stapo_megatron.trainer.seeds import Seeds


def test_seed_streams_keep_their_values():
    seeds = Seeds(1234)
    assert (seeds.model_init, seeds.data_split, seeds.data_order, seeds.engine()) == (1234, 1234, 1234, 1234)
    assert (seeds.warmstart_order, seeds.evaluation) == (1234 + 99, 1234 + 7)
    assert seeds.rollout(5) == 1234 * 1_000_003 + 5
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


def test_warmstart_cache_key_follows_what_determines_the_weights(tmp_path):
    import dataclasses

    from stapo_megatron.trainer import warmstart as warmstart_cache
    from stapo_megatron.recipes.tiny import tiny_demo

    cfg, ws = tiny_demo(run_dir=str(tmp_path / "runs" / "demo"))
    assert ws.cache_dir == str(tmp_path / "runs" / ".warmstart-cache")
    key = warmstart_cache.cache_key(cfg, ws, seed=1234, data_seed=1234, world_size=2)
    # not part of the weights: where they are cached or copied, the RL seed, RL's settings
    same = [dataclasses.replace(ws, cache_dir="/elsewhere", save_to="/x"), ws]
    assert {warmstart_cache.cache_key(cfg, w, 1234, 1234, 2) for w in same} == {key}
    rl_only = dataclasses.replace(cfg, seed=7, steps=3, optim=dataclasses.replace(cfg.optim, lr=1.0))
    assert warmstart_cache.cache_key(rl_only, ws, 1234, 1234, 2) == key
    # part of them: the warm-start recipe, its seed, the data, the layout
    changed = [
        warmstart_cache.cache_key(cfg, dataclasses.replace(ws, label_smoothing=0.05), 1234, 1234, 2),
        warmstart_cache.cache_key(cfg, ws, 1, 1234, 2),
        warmstart_cache.cache_key(cfg, ws, 1234, 1, 2),
        warmstart_cache.cache_key(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_train=10)),
                                  ws, 1234, 1234, 2),
        warmstart_cache.cache_key(cfg, ws, 1234, 1234, 4),
        warmstart_cache.cache_key(dataclasses.replace(cfg, micro_batch_size=4), ws, 1234, 1234, 2),
    ]
    assert key not in changed and len(set(changed)) == len(changed)
    assert warmstart_cache.cached_path(cfg, ws, 1234, 1234, 2) == f"{ws.cache_dir}/warmstart-{key}"
    assert warmstart_cache.cached_path(cfg, dataclasses.replace(ws, cache_dir=""), 1234, 1234, 2) is None
