"""The rollout engine contract: `RolloutEngine` (what the trainer, the evaluator and ``stapo-eval``
call) and `Sample` (what ``generate`` returns), with the argument checks every engine shares.

Mixture-of-experts policies: an engine asked to (``RolloutConfig.return_routed_experts``) also
returns the experts its router chose per token and layer (``Sample.routed_experts``), which
`stapo_megatron.trainer.routing` compares with Megatron's routing of the same tokens.

An engine is built from an HF folder and a `stapo_megatron.rollout.config.RolloutConfig`
(``Engine(hf_dir, config)``) and registered by dotted path in `stapo_megatron.rollout.registry`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterable, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.train.parallel import Groups, barrier, collective_timeout

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""Any of these in an HF folder means it carries a tokenizer (else ``Sample.text`` is "")."""


@dataclasses.dataclass
class Sample:
    """One sampled response."""

    token_ids: list[int]
    """Response token ids (prompt excluded; EOS included when generation stopped on it)."""
    logprobs: list[float]
    """Sampler's log-prob of each token of ``token_ids`` (of the distribution it was drawn from:
    after temperature, and after top-p truncation when top_p < 1)."""
    text: str
    """Detokenised response; "" when the HF folder has no tokenizer."""
    finish_reason: str
    """"stop" (EOS or stop token) or "length" (hit max_tokens)."""
    routed_experts: Optional[torch.Tensor] = None
    """Mixture-of-experts policies, when the engine records routing (``RolloutConfig.
    return_routed_experts``): int ``[P + R - 1, num_layers, top_k]``, the experts the engine's
    router chose for every token it forwarded (the P prompt tokens and the R response tokens but
    the last, which is sampled and never forwarded), per MoE layer, in the router's top-k order.
    vLLM's ``CompletionOutput.routed_experts`` layout; None when not recorded (dense models)."""


class RolloutEngine(Protocol):
    """What every rollout engine does, in the training processes (SPMD, one per rank or per
    rollout-TP group)."""

    def generate(self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: Optional[int] = None) -> list[list[Sample]]:
        """``n`` samples per prompt; prompt i's j-th sample seeded ``seed + i * n + j``."""

    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors (`stapo_megatron.rollout.weight_sync.iter_hf_weights`)."""

    def sleep(self) -> None:
        """Free the engine's device memory for training (a no-op where unsupported)."""

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Take the memory back: all of it (``tags`` None), or only ``("weights",)`` (before the
        weight sync) or ``("kv_cache",)`` (after it), vLLM's tags."""

    def shutdown(self) -> None:
        """Release the engine (without destroying the default process group)."""


def has_tokenizer(hf_dir: str) -> bool:
    """Whether the HF folder ``hf_dir`` carries a tokenizer (`TOKENIZER_FILES`)."""
    return any(os.path.isfile(os.path.join(hf_dir, f)) for f in TOKENIZER_FILES)


def check_generate_args(prompt_token_ids, n: int, temperature: float, top_p: float, max_tokens: int) -> None:
    """ValueError for arguments of ``generate`` that no engine can sample with."""
    if n < 1 or max_tokens < 1:
        raise ValueError(f"n ({n}) and max_tokens ({max_tokens}) must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    for i, ids in enumerate(prompt_token_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty")


def generate_for_group(engine: RolloutEngine, mp_group: Optional[dist.ProcessGroup], prompt_token_ids, n: int,
                       temperature: float, top_p: float, max_tokens: int, seed: Optional[int],
                       wait_timeout_s: Optional[float] = None) -> list[list[Sample]]:
    """``engine.generate``, then the group's first rank's samples broadcast over ``mp_group``:
    every rank of a model-parallel group must train (and be scored) on identical samples.

    ``wait_timeout_s``: every rank of the job (all must call this) then waits here for all the
    others' samples, and this call's collectives wait up to ``wait_timeout_s`` instead of the
    groups' own timeout: the wait for the slowest engine (a 15k-token response) happens here,
    not in the next collective under ``TrainerConfig.distributed_timeout_s``."""
    waiting = wait_timeout_s is not None and dist.is_initialized()
    with collective_timeout(wait_timeout_s, [None, mp_group]) if waiting else contextlib.nullcontext():
        samples = engine.generate(prompt_token_ids, n, temperature, top_p, max_tokens, seed=seed)
        if mp_group is not None and dist.get_world_size(mp_group) > 1:
            box = [samples]
            dist.broadcast_object_list(box, src=dist.get_process_group_ranks(mp_group)[0], group=mp_group)
            samples = box[0]
        if waiting:
            barrier()
    return samples


def generate_context_parallel_share(engine: RolloutEngine, groups: Groups, prompt_token_ids, n: int,
                                    temperature: float, top_p: float, max_tokens: int, seed: Optional[int],
                                    wait_timeout_s: Optional[float] = None) -> Tuple[int, list[list[Sample]]]:
    """This context-parallel rank's share of a data-parallel replica's prompts, sampled with the
    seeds those prompts have without CP (`generate_for_group` over ``groups.mp``).

    The CP ranks of a replica hold the same prompts; rather than each sampling all of them (CP - 1
    copies wasted), CP rank c of CP samples prompts [c P // CP, (c + 1) P // CP) of the P (shares
    differ by at most one; one may be empty), prompt i's j-th sample seeded ``seed + i * n + j``
    as in one call over all P. Without CP that is all P prompts. Every rank of the job calls this.

    Returns:
        ``(start, samples)``: the index of the share's first prompt in ``prompt_token_ids`` and
        its samples (``samples[i]`` belongs to prompt ``start + i``).
    """
    cp, rank = groups.cp_size, dist.get_rank(groups.cp) if groups.cp is not None else 0
    start, end = len(prompt_token_ids) * rank // cp, len(prompt_token_ids) * (rank + 1) // cp
    samples = generate_for_group(engine, groups.mp, prompt_token_ids[start:end], n, temperature, top_p, max_tokens,
                                 seed=None if seed is None else seed + start * n, wait_timeout_s=wait_timeout_s)
    return start, samples
