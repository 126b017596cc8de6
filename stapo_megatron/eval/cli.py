"""stapo-eval: avg@k / pass@k of a model on named evaluation sets, both decodings, a table out.

    stapo-eval MODEL --bench-dir DIR --out OUT                      # the paper's six benchmarks
    stapo-eval MODEL --set name=gsm,path=gsm.jsonl,k=4,prompt_field=question --out OUT

MODEL is an HF folder (config.json + safetensors + tokenizer) or a Megatron checkpoint: one
converted by ``stapo-convert hf-to-mcore``, a training run folder (its newest checkpoint) or one
of its step folders. A checkpoint is first exported to HF with the project's converter
(``stapo_megatron.conversion.mcore_to_hf``; a training checkpoint needs ``--hf-config``, the HF folder the run
started from, unless it carries its own config); the HF folder starts the project's rollout
engine (``rollout.registry.build_engine``: vLLM where installed, else transformers), which
samples k responses per problem for each decoding; a reward function scores them
(``stapo_megatron.eval.scoring``): ``--reward``, by default the run's own (its ``config.yaml``,
as the in-training evaluation scores), else math_verify; eval.json names it (``settings.reward``). Writes ``OUT/eval.json`` (all numbers: avg@k, pass@k, response
lengths in tokens, truncation rate, generation and scoring seconds per set and decoding),
``OUT/eval.md`` (the table, also printed) and ``OUT/generations.jsonl`` (one line per sample: set,
decoding, id, prompt, sample, response, reward, response_length, truncated).

Progress (prompts generated of the total and the rate, per set and decoding) and the engine's log
lines go to stderr; stdout holds only the result table.

Exit codes: 0 success, 2 bad input (the message names the problem).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from typing import List, Optional, Sequence, Tuple

from stapo_megatron.eval.config import eval_set_configs
from stapo_megatron.data.examples import tokenize_prompts
from stapo_megatron.eval.config import Decoding
from stapo_megatron.eval.generate import EvalProgress, engine_generate_fn
from stapo_megatron.eval.scoring import PAPER_DECODINGS, EvalSet, evaluate_sets, format_table, load_eval_set, paper_sets
from stapo_megatron.rewards.functions import get_reward
from stapo_megatron.rewards.scorer import RewardScorer
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.eval.engine import build_eval_engine, check_tensor_parallel
from stapo_megatron.rollout.registry import ENGINE_NAMES, resolve_engine


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and the default of every option that has one in --help (not
    "(default: None)" for required or unset options, nor a second default where the help names it)."""

    def _get_help_string(self, action):
        if action.required or action.default in (None, "", False, []) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""Any of these marks a folder with a tokenizer."""


def check_tokenizer(hf_dir: str) -> None:
    """ValueError naming ``hf_dir`` when it holds no tokenizer (a weights-only export)."""
    if not any(os.path.isfile(os.path.join(hf_dir, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{hf_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the tokenizer "
                         "files of the original HF model into it, or for a Megatron checkpoint pass --hf-config "
                         "with the original HF folder")


def resolve_dtype(hf_dir: str, dtype: str) -> str:
    """``--dtype auto`` as the folder's ``torch_dtype`` / ``dtype`` (vLLM's own "auto" runs fp32
    weights in a half type); other values unchanged."""
    if dtype != "auto":
        return dtype
    from stapo_megatron.bridge.hf_config import load_hf_config

    cfg = load_hf_config(hf_dir)
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "auto").replace("torch.", "")


def model_len_for(prompt_lens: List[int], max_tokens: int, hf_dir: str) -> int:
    """vLLM's ``max_model_len``: the longest kept prompt plus ``max_tokens`` (rounded up to 8),
    checked against the model's ``max_position_embeddings``."""
    from stapo_megatron.bridge.hf_config import load_hf_config

    needed = (max(prompt_lens, default=0) + max_tokens + 7) // 8 * 8
    limit = load_hf_config(hf_dir).get("max_position_embeddings")
    if limit and needed > limit:
        raise ValueError(f"the longest prompt ({max(prompt_lens)} tokens) plus --max-tokens {max_tokens} needs "
                         f"{needed} positions but {hf_dir} has max_position_embeddings={limit}: lower "
                         f"--max-tokens to at most {limit - max(prompt_lens)}")
    return min(needed, limit) if limit else needed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stapo-eval", description=__doc__.split("\n")[0],
                                formatter_class=_HelpFormatter,
                                epilog="Sets: --bench-dir finds <name>.jsonl of aime24, aime25, amc23 (k=32), "
                                       "math500, minerva, olympiadbench (k=4); --set takes EvalSetConfig fields "
                                       "as key=value pairs separated by commas, decodings joined with '+'.")
    p.add_argument("model", help="HF folder, or Megatron checkpoint (converted, training run or step folder)")
    p.add_argument("--out", required=True, help="output folder for eval.json and eval.md")
    p.add_argument("--bench-dir", help="folder with the paper's benchmarks as <name>.jsonl (missing ones skipped)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE,...",
                   help="a named set: name=..,path=..[,k=4][,prompt_field=..][,answer_field=..]"
                        "[,decodings=T1.0_p1.0+T0.7_p0.9]; repeatable")
    p.add_argument("--decodings", default="+".join(d.name for d in PAPER_DECODINGS),
                   help="decodings of the --bench-dir sets, T<temperature>_p<top_p> joined with '+' "
                        "(default: the paper's two, %(default)s)")
    p.add_argument("--k", type=int, help="use this k for every set (quick runs)")
    p.add_argument("--hf-config", help="HF folder with config.json/tokenizer, for a training checkpoint")
    p.add_argument("--hf-out", help="keep the HF export of a Megatron checkpoint here (default: a temporary "
                                    "folder under --out, or under $TMPDIR when --out lies inside the model "
                                    "folder; removed afterwards)")
    p.add_argument("--engine", choices=ENGINE_NAMES, default="auto", help="rollout engine")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many GPUs (vLLM's own worker processes; vLLM engine only)")
    p.add_argument("--dtype", default="auto", help="engine dtype (auto = the HF folder's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's GPU memory share")
    p.add_argument("--max-tokens", type=int, default=20480, help="response length limit (the paper: 20480)")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="longer prompts are dropped (warned)")
    p.add_argument("--no-chat-template", action="store_true", help="plain prompts (question + instruction)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i, sample j: seed + i k + j)")
    p.add_argument("--reward", default="",
                   help="reward function (a name of rewards.REWARDS or a dotted path; default: the run's "
                        "reward from its config.yaml, else math_verify)")
    p.add_argument("--reward-workers", type=int, default=2, help="reward-checking processes")
    p.add_argument("--reward-timeout", type=float, default=5.0, help="time bound of one answer check (s)")
    return p


def load_sets(args: argparse.Namespace) -> List[EvalSet]:
    """The sets of ``--bench-dir`` and ``--set``; ValueError if there are none."""
    sets: List[EvalSet] = []
    if args.bench_dir:
        decodings = tuple(Decoding.from_name(d) for d in args.decodings.split("+"))
        found, _ = paper_sets(args.bench_dir, decodings)
        sets += found
    sets += [load_eval_set(cfg) for cfg in eval_set_configs(";".join(args.sets))]
    if not sets:
        raise ValueError("no evaluation sets: give --bench-dir with <name>.jsonl files or --set")
    return sets


DEFAULT_REWARD = "math_verify"
"""The reward of a model folder that is not a training run (an HF folder, a converted checkpoint)."""


def run_reward(model: str) -> Tuple[Optional[str], Optional[str]]:
    """(reward, the config.yaml it was read from) of a training run or step folder, else (None, None).

    The run's ``config.yaml`` is looked for in the step folder itself, then in the run folder (a
    step folder's grandparent), and read with the launcher's own reader
    (`stapo_megatron.config.yaml_io.load_config`: the reward is ``trainer.reward.name``).

    Raises:
        ValueError: a config.yaml that reader refuses, naming the file and ``--reward``.
    """
    from stapo_megatron.config.yaml_io import load_config

    for folder in (model, os.path.dirname(os.path.dirname(os.path.abspath(model)))):
        path = os.path.join(folder, "config.yaml")
        if os.path.isfile(path):
            try:
                cfg = load_config(path)[1]
            except ValueError as e:
                raise ValueError(f"cannot read the run's reward from {path}: {e}; pass --reward NAME "
                                 "to choose the reward instead") from None
            return cfg.reward.name, path
    return None, None


def choose_reward(args: argparse.Namespace) -> Tuple[str, str]:
    """(reward name, where it came from): --reward, the run's config.yaml, or the default."""
    if args.reward:
        return args.reward, "--reward"
    reward, path = run_reward(args.model)
    return (reward, path) if reward else (DEFAULT_REWARD, "default (no run config.yaml)")


def export_dir_parent(model: str, out: str) -> str:
    """Where a temporary HF export goes: under ``out``, unless ``out`` lies inside the model
    folder (``stapo-eval RUN --out RUN/eval``), whose converter would refuse to write into its
    input: then the system's temporary folder (``$TMPDIR``)."""
    model_abs, out_abs = os.path.realpath(model), os.path.realpath(out)
    inside = os.path.commonpath([model_abs, out_abs]) == model_abs
    return tempfile.gettempdir() if inside else out


def is_hf_folder(path: str) -> bool:
    """An HF model folder: config.json and safetensors weights."""
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        name.endswith(".safetensors") for name in os.listdir(path))


def export_to_hf(ckpt: str, out: str, hf_config: Optional[str]) -> str:
    """A Megatron checkpoint exported to an HF folder ``out`` with the project's converter."""
    from stapo_megatron.conversion.mcore_to_hf import convert_mcore_to_hf

    convert_mcore_to_hf(ckpt, out, hf_config_dir=hf_config, stream=sys.stderr)
    return out


def _tokenized(sets: List[EvalSet], tokenizer, args) -> List[int]:
    """Drop each set's prompts longer than --max-prompt-len (one warning per set), in place;
    the token lengths of the kept prompts."""
    lengths = []
    for s in sets:
        ids, s.examples, _ = tokenize_prompts(tokenizer, s.examples, args.max_prompt_len, not args.no_chat_template)
        lengths += [len(i) for i in ids]
    return lengths


def evaluate_model(hf_dir: str, sets: List[EvalSet], args: argparse.Namespace) -> dict:
    """Sample and score every set with the rollout engine started from ``hf_dir``."""
    from transformers import AutoTokenizer

    check_tokenizer(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    max_model_len = model_len_for(_tokenized(sets, tokenizer, args), args.max_tokens, hf_dir)
    reward_name, reward_source = choose_reward(args)
    reward = get_reward(reward_name)  # a bad name fails before the engine starts
    engine = build_eval_engine(args.engine, hf_dir, RolloutConfig(
        max_model_len=max_model_len, seed=args.seed, dtype=resolve_dtype(hf_dir, args.dtype),
        gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size))
    progress = EvalProgress(sys.stderr)
    path = os.path.join(args.out, GENERATIONS)
    try:
        generate = engine_generate_fn(engine, tokenizer, args.max_tokens, not args.no_chat_template, args.seed,
                                      progress)
        with RewardScorer(num_workers=args.reward_workers, timeout_s=args.reward_timeout, score_fn=reward.score_fn,
                          failure_reward=reward.failure_reward) as scorer, \
                open(path + ".partial", "w", encoding="utf-8") as generations:
            results = evaluate_sets(generate, sets, scorer, args.k, progress,
                                    lambda record: generations.write(json.dumps(record) + "\n"))
        os.replace(path + ".partial", path)
    finally:
        engine.shutdown()
    results["settings"] = {"model": os.path.abspath(args.model), "engine": resolve_engine(args.engine),
                           "tensor_parallel_size": args.tensor_parallel_size, "seed": args.seed,
                           "max_tokens": args.max_tokens, "max_prompt_len": args.max_prompt_len,
                           "chat_template": not args.no_chat_template, "k_override": args.k,
                           "reward": reward.name, "reward_source": reward_source}
    return results


GENERATIONS = "generations.jsonl"
"""The samples of a run, next to eval.json (written as ``.partial`` until the run is complete)."""


def run(args: argparse.Namespace) -> dict:
    """Load the sets, get an HF folder for the model, evaluate, write eval.json and eval.md."""
    if not os.path.isdir(args.model):
        raise ValueError(f"model {args.model!r} is not a folder (an HF folder or a Megatron checkpoint)")
    check_tensor_parallel(args.engine, args.tensor_parallel_size)  # before a checkpoint's export
    sets = load_sets(args)
    os.makedirs(args.out, exist_ok=True)
    if is_hf_folder(args.model):
        results = evaluate_model(args.model, sets, args)
    elif args.hf_out:
        results = evaluate_model(export_to_hf(args.model, args.hf_out, args.hf_config), sets, args)
    else:
        tmp = tempfile.mkdtemp(prefix="hf-export-", dir=export_dir_parent(args.model, args.out))
        try:
            results = evaluate_model(export_to_hf(args.model, os.path.join(tmp, "hf"), args.hf_config), sets, args)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    table = format_table(results)
    with open(os.path.join(args.out, "eval.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "eval.md"), "w", encoding="utf-8") as f:
        f.write(table)
    print(table, end="")
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point; returns the exit code."""
    args = _parser().parse_args(argv)
    # vLLM logs to stdout by default; the table is stdout's only content (read at vLLM's import)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        with warnings.catch_warnings():
            # megatron-core warns about absent transformer-engine/apex on every CPU import.
            warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
            run(args)
        return 0
    except (ValueError, OSError) as e:  # OSError: missing files, a read-only or full disk
        print(f"stapo-eval: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
