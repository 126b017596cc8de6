"""The rollout engine contract: `RolloutEngine` (what the trainer, the evaluator and ``stapo-eval``
call) and `Sample` (what ``generate`` returns), with the argument checks every engine shares.

Mixture-of-experts policies: an engine asked to (``RolloutConfig.return_routed_experts``) also
returns the experts its router chose per token and layer (``Sample.routed_experts``), which
`stapo_megatron.trainer.routing` compares with Megatron's routing of the same tokens.

An engine is built from an HF folder and a `stapo_megatron.rollout.config.RolloutConfig`
(``Engine(hf_dir, config)``) and registered by dotted path in `stapo_megatron.rollout.registry`.
How the training ranks share one engine's samples (the SPMD collectives) is
`stapo_megatron.rollout.spmd`; this module imports no process-group code.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, List, Optional, Protocol, Sequence, Tuple, Union

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""Any of these in an HF folder means it carries a tokenizer (else ``Sample.text`` is "")."""


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """What an engine class can do beyond `RolloutEngine`'s calls, declared as its
    ``capabilities`` attribute; the config's validation asks for it by the engine's name
    (`stapo_megatron.rollout.registry.engine_capabilities`) instead of naming engines."""

    streaming: bool = False
    """Admits requests and steps them one decode iteration at a time (``rollout.mode="streaming"``)."""
    partial_continuation: bool = False
    """``detokenize``: a response continued from its tokens so far (``rollout.mode="partial"``)."""
    router_replay: bool = False
    """Returns the experts each token was routed to (``rollout.routing_replay``)."""


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
    versions: Optional[list[int]] = None
    """The policy version (steps trained) that sampled each token of ``token_ids``, where the
    weights can change while a response is sampled: partial rollouts (`stapo_megatron.serve.
    partial`, a response continued over steps) and the streaming generator (`stapo_megatron.
    serve.streaming`, weights loaded between decode iterations); None: one policy sampled them
    all (``generate``)."""


class RolloutEngine(Protocol):
    """What every rollout engine does, in the training processes (SPMD, one per rank or per
    rollout-TP group)."""

    def generate(self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: Optional[Union[int, Sequence[int]]] = None) -> list[list[Sample]]:
        """``n`` samples per prompt; prompt i's j-th sample seeded ``seed + i * n + j`` (an int
        ``seed``) or ``seed[i] + j`` (one seed per prompt: several requests' prompts in one call,
        each sampled as in its own; `prompt_seeds`); None: the engine's own RNG stream."""

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


def prompt_seeds(seed: Optional[Union[int, Sequence[int]]], num_prompts: int, n: int) -> Optional[List[int]]:
    """The first sample's seed of each prompt of a ``generate`` call (its j-th sample's is that
    plus j): ``seed + i * n`` for an int ``seed``, ``seed`` itself for one int per prompt, None
    for None.

    Raises:
        ValueError: a per-prompt ``seed`` of another length than the prompts.
    """
    if seed is None:
        return None
    if isinstance(seed, int):
        return [seed + i * n for i in range(num_prompts)]
    seeds = [int(s) for s in seed]
    if len(seeds) != num_prompts:
        raise ValueError(f"generate's seed holds {len(seeds)} per-prompt seeds for {num_prompts} prompts")
    return seeds


def check_generate_args(prompt_token_ids, n: int, temperature: float, top_p: float, max_tokens: int) -> None:
    """ValueError for arguments of ``generate`` that no engine can sample with."""
    if n < 1 or max_tokens < 1:
        raise ValueError(f"n ({n}) and max_tokens ({max_tokens}) must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    for i, ids in enumerate(prompt_token_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty")
