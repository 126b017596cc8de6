"""Tier a: the warm-start's cache key follows exactly what determines the warmed-up weights."""


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
