"""The in-training evaluator: the loop asks ``should_evaluate(step)`` and then ``evaluate(step)``.

It scores the held-out set (``eval_accuracy``: avg@k with k = ``eval.samples`` at
``eval.temperature``, a sample correct when its reward is positive, under 1/0 and +1/-1 rewards
alike) and every named set of ``TrainerConfig.eval.sets`` per decoding
(``eval/<set>/<decoding>/avg@<k>`` and ``pass@<k>``), sampled with one seed (`Seeds.evaluation`)
so that evaluations at different steps differ by the weights only.

Each set is spread over DP x CP as the training rollouts are (`trainer.replicas`): DP replica d
takes problems d, d + DP, d + 2 DP, ..., and CP rank c of the replica samples and scores the c-th
contiguous 1/CP of those with the seeds they have without CP
(`rollout.spmd.generate_context_parallel_share`); the counts are summed over DP x CP, so each
problem counts once, sampled as at CP = 1 with the same DP (the same results, up to numerics an
engine's batching may change). The logged samples (rank 0's) are its replica's first ones, as at
CP = 1: gathered over CP.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.data.examples import tokenize_prompts
from stapo_megatron.eval.config import Decoding, EvalConfig
from stapo_megatron.eval.scoring import Counts, EvalSet, load_eval_set, score_responses, summarize
from stapo_megatron.rewards.scorer import RewardScorer
from stapo_megatron.rollout.base import RolloutEngine
from stapo_megatron.rollout.spmd import generate_context_parallel_share
from stapo_megatron.mcore.parallel import Groups
from stapo_megatron.utils import collective_device


def eval_max_len(config: EvalConfig, training_max_response_len: int) -> int:
    """Held-out responses' token limit: `EvalConfig.max_response_len`, else training's."""
    return config.max_response_len or training_max_response_len


def load_eval_sets(config: EvalConfig, tokenizer, max_prompt_len: int,
                   use_chat_template: bool) -> List[Tuple[EvalSet, List[List[int]]]]:
    """``config.sets`` loaded and tokenized as the held-out set is (``data.max_prompt_len``,
    ``data.use_chat_template``): (EvalSet with the kept problems, their prompt token ids) per set."""
    out = []
    for set_cfg in config.sets:
        eval_set = load_eval_set(set_cfg)
        ids, eval_set.examples, _ = tokenize_prompts(tokenizer, eval_set.examples, max_prompt_len, use_chat_template)
        out.append((eval_set, ids))
    return out


class Evaluator:
    """Scores the policy the rollout engine holds on the held-out set and the named sets."""

    def __init__(self, config: EvalConfig, held_out: Tuple[List[List[int]], List],
                 eval_sets: List[Tuple[EvalSet, List[List[int]]]], engine: RolloutEngine, scorer: RewardScorer,
                 groups: Groups, seed: int, logger, steps: int, max_response_len: int, timeout_s: float,
                 num_samples: int):
        """``steps``: the run's last step (always evaluated); ``max_response_len``: the responses'
        limit (`eval_max_len`); ``timeout_s``: the rollout timeout; ``num_samples``: samples
        logged per evaluation (`LoggingConfig.num_samples`)."""
        self.config, self.held_out, self.eval_sets = config, held_out, eval_sets
        self.steps, self.max_response_len, self.timeout_s, self.num_samples = (steps, max_response_len, timeout_s,
                                                                               num_samples)
        self.engine, self.scorer, self.groups, self.seed, self.logger = engine, scorer, groups, seed, logger
        self.dp_size, self.dp_rank = dist.get_world_size(groups.dp), dist.get_rank(groups.dp)
        self.device = collective_device(groups.tokens)
        self.rank = dist.get_rank()

    def should_evaluate(self, step: int) -> bool:
        """At step 0, every ``eval.every`` steps and at the last step (never with eval.every 0)."""
        every = self.config.every
        return bool(every) and (step % every == 0 or step == self.steps)

    def evaluate(self, step: int) -> Dict[str, float]:
        """The eval row of ``step`` (logged, printed on rank 0, returned)."""
        t0 = time.perf_counter()
        held_out = Decoding(self.config.temperature, 1.0, "held_out")
        samples: List[Dict] = []
        row = dict(kind="eval", step=step)
        if self.held_out[0]:  # none when data.eval_path is unset and eval.sets are the evaluation
            counts = self._counts(*self.held_out, self.config.samples, held_out, samples)
            row.update(eval_accuracy=summarize(counts, self.config.samples, held_out)["avg@k"],
                       eval_num=int(counts.num_samples))
        for eval_set, ids in self.eval_sets:
            for decoding in eval_set.decodings:
                result = summarize(self._counts(ids, eval_set.examples, eval_set.k, decoding), eval_set.k, decoding)
                for metric in ("avg", "pass"):
                    row[f"eval/{eval_set.name}/{decoding.name}/{metric}@{eval_set.k}"] = result[f"{metric}@k"]
        row["time_eval"] = time.perf_counter() - t0
        self.logger.log(row)
        self.logger.log_samples(step, samples)
        self._print(row)
        return row

    def _counts(self, prompt_ids: List[List[int]], examples: List, k: int, decoding: Decoding,
                samples_out: Optional[List[Dict]] = None) -> Counts:
        """avg@k sums of ``k`` samples per problem, this rank's share (module docstring) sampled
        and scored here (``scoring.score_responses``), then summed over DP x CP (float32, as
        every metric sum). ``samples_out``, if given, gets the first `LoggingConfig.num_samples`
        samples (prompt, response, answer, reward) of this rank's replica."""
        replica = list(range(self.dp_rank, len(prompt_ids), self.dp_size))
        settings = decoding.settings(k, self.max_response_len, self.seed)
        start, samples = generate_context_parallel_share(self.engine, self.groups, [prompt_ids[i] for i in replica],
                                                         settings, wait_timeout_s=self.timeout_s)
        idx = replica[start:start + len(samples)]
        texts = [[s.text for s in group] for group in samples]
        rewards: List[float] = []
        counts = score_responses(texts, [examples[i] for i in idx], k, self.scorer, rewards)
        if samples_out is not None:
            flat = [(examples[i], t) for i, group in zip(idx, texts) for t in group]
            mine = [dict(prompt=ex.prompt, response=t, answer=ex.answer, reward=r) for (ex, t), r in zip(flat, rewards)]
            samples_out.extend(self._replica_samples(mine[:self.num_samples]))
        sums = torch.tensor(counts.as_list(), device=self.device)
        dist.all_reduce(sums, group=self.groups.tokens)
        return Counts(*sums)

    def _replica_samples(self, mine: List[Dict]) -> List[Dict]:
        """The replica's samples in problem order from each CP rank's first ones (``mine``): the
        CP ranks' shares follow each other, so the first `LoggingConfig.num_samples` are those
        CP = 1 logs."""
        if self.groups.cp_size == 1:
            return mine
        parts: List[Optional[List[Dict]]] = [None] * self.groups.cp_size
        dist.all_gather_object(parts, mine, group=self.groups.cp)
        return [sample for part in parts for sample in part]

    def _print(self, r: Dict) -> None:
        if self.rank == 0:
            held_out = (f"held-out accuracy {r['eval_accuracy']:.3f} ({r['eval_num']} samples, "
                        if "eval_accuracy" in r else "no held-out set (")
            print(f"eval  {r['step']:>4} | {held_out}{r['time_eval']:.1f}s)", flush=True)
            for key, value in r.items():
                if key.startswith("eval/"):
                    print(f"eval  {r['step']:>4} | {key[len('eval/'):]} {value:.3f}", flush=True)
