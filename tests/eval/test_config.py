"""Tier a: evaluation sets as configs: their checks (each naming what is wrong), the
``eval.sets`` string of key=value overrides, and ``bench_dir=`` for the paper benchmarks."""

import pytest

from stapo_megatron.config import TrainerConfig
from stapo_megatron.eval.config import EvalConfig, EvalSetConfig
from stapo_megatron.eval.scoring import PAPER_DECODINGS
from tests.helpers.jsonl_files import _write_jsonl


@pytest.mark.parametrize("sets, message", [
    ([{"name": "a/b", "path": "x"}], "without '/'"),
    ([{"name": "a", "path": ""}], "path is empty"),
    ([{"name": "a", "path": "x", "k": 0}], "k must be >= 1"),
    ([{"name": "a", "path": "x", "decodings": ()}], "decodings must be non-empty and unique"),
    ([{"name": "a", "path": "x", "decodings": ("T1_p1", "T1_p1")}], "decodings must be non-empty and unique"),
    ([{"name": "a", "path": "x"}, {"name": "a", "path": "y"}], "names must be unique"),
    ([{"name": "a", "paths": "x"}], r"has no field 'paths' \(did you mean 'path'"),
    ("name=a,path=x,k=four", "k must be an integer"),
    ("name=a,path", "expected FIELD=VALUE pairs"),
    (5, "must be a list of EvalSetConfig"),
])
def test_eval_sets_config_errors(sets, message):
    with pytest.raises(ValueError, match=message):
        EvalConfig(sets=sets)


def test_eval_sets_from_a_string():
    cfg = TrainerConfig(eval=EvalConfig(
        sets="name=aime24,path=/b/aime24.jsonl,k=32;name=m,path=/b/m,decodings=T0.6_p0.95+T1_p1;"))
    assert cfg.eval.sets == [EvalSetConfig(name="aime24", path="/b/aime24.jsonl", k=32),
                             EvalSetConfig(name="m", path="/b/m", decodings=("T0.6_p0.95", "T1_p1"))]


def test_bench_dir_in_an_eval_sets_string_is_the_paper_benchmarks_found_there(tmp_path):
    """A cluster launch has only key=value overrides: ``eval.sets=bench_dir=DIR`` wires in the
    benchmarks prepare_data wrote (`with_paper_benchmarks` needs Python), also
    beside other sets, through the same parser the launch entry uses."""
    from stapo_megatron.eval.config import eval_set_configs
    from stapo_megatron.launch.entry import build_config, parse_arguments

    bench = tmp_path / "bench"
    bench.mkdir()
    for name in ("aime25", "math500", "notes"):
        _write_jsonl(bench / f"{name}.jsonl", [{"prompt": "1+1", "answer": "2"}])
    sets = eval_set_configs(f"bench_dir={bench};name=gsm,path=/data/gsm.jsonl,k=2")
    assert [(s.name, s.k, s.path) for s in sets] == [("aime25", 32, str(bench / "aime25.jsonl")),
                                                     ("math500", 4, str(bench / "math500.jsonl")),
                                                     ("gsm", 2, "/data/gsm.jsonl")]
    assert sets[0].decodings == tuple(d.name for d in PAPER_DECODINGS)
    with pytest.raises(ValueError, match="bench_dir=DIR takes no other fields"):
        eval_set_configs(f"bench_dir={bench},k=4")
    with pytest.raises(ValueError, match="benchmark folder '/nonexistent' does not exist"):
        eval_set_configs("bench_dir=/nonexistent")
    arguments = parse_arguments(["model.hf_dir=/m", "model.megatron_ckpt=/c", "data.train_path=/t.jsonl",
                                 f"eval.sets=bench_dir={bench}"])
    cfg, _ = build_config("qwen3_8b", **arguments)  # the paths check passes: the sets are the evaluation
    assert [s.name for s in cfg.eval.sets] == ["aime25", "math500"] and cfg.data.eval_path is None


def test_a_decoding_samples_with_its_temperature_and_top_p():
    """The evaluator's requests: a decoding's `SamplingSettings` (k samples, the length limit, the seed)."""
    from stapo_megatron.eval.config import Decoding
    from stapo_megatron.rollout.config import SamplingSettings

    settings = Decoding.from_name("T0.6_p0.95").settings(k=4, max_tokens=32, seed=7)
    assert settings == SamplingSettings(n=4, temperature=0.6, top_p=0.95, max_tokens=32, seed=7)
    assert Decoding.from_name("T0_p1").settings(1, 8, None).temperature == 0.0  # greedy stays allowed
