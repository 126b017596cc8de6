"""A rollout engine without vLLM: transformers ``generate`` on an HF model in this process.

For GPUs where vLLM is not installed (a plain pip install, the GPU test machine) and for tests.
Same interface as `VLLMEngine`: ``generate`` returns `Sample` lists, ``update_weights`` takes the
streamed HF tensors of `stapo_megatron.rollout.weight_sync.iter_hf_weights` (the bridge's
mapping), ``sleep``/``wake_up`` are no-ops, ``shutdown`` drops the model. Every rank holds its own
engine (no tensor parallelism) and samples its own prompts.

Sampling, exactly (one `_SeededSampler` logits processor; ``generate`` runs greedy on its output):

    logp_BV = log_softmax(z_BV / T), then top-p: tokens outside the smallest set whose
              probability mass reaches top_p get -inf and logp is renormalised;
    y_B     = argmax_v(logp_BV + g_BV),  g ~ Gumbel(0, 1) drawn from row b's own generator;
    logprob = logp_BV[b, y_B]  (T = 0: greedy y = argmax z, logprob = log_softmax(z)[y]).

So the reported log-probs are those of the distribution the token was drawn from, as vLLM's
``processed_logprobs`` (with top_p = 1 they equal Megatron's log_softmax(logits / T)). Row
(prompt i, sample j) draws from a generator seeded ``seed + i * n + j`` (``seed[i] + j`` with one
seed per prompt): the same seed gives the same samples whatever the batching (up to kernel-level
numerics of padded batches) and whatever the device (the generators and their noise are on the
CPU; up to a near-tie that the device's rounding breaks the other way).

Mixture-of-experts models (transformers' ``Qwen3MoeForCausalLM``): transformers 5 keeps each
layer's experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first, and
``mlp.experts.down_proj`` [E, H, I]) while checkpoints and the weight stream name them one expert
at a time (``mlp.experts.<e>.gate_proj.weight`` ...): ``update_weights`` writes each streamed
expert tensor into its slice (`_param_slots`). With ``RolloutConfig.return_routed_experts`` a
forward hook on every router (``mlp.gate``, which returns logits, top-k weights and top-k
indices) records the experts chosen for every token forwarded while generating: the prompt
(prefill) and each sampled token but the last (decode), i.e. the routing the samples were
really drawn with, returned as ``Sample.routed_experts``.

Legend: B = rows (prompt x sample) of one batch, V = vocabulary, T = positions, L = MoE
layers, K = experts per token (top-k), E = experts, I = expert FFN width, H = hidden size.
"""

from __future__ import annotations

import os
import re
from typing import Iterable, Optional, Sequence, Union

import torch

from stapo_megatron.rollout.base import EngineCapabilities, Sample, check_generate_args, has_tokenizer, prompt_seeds
from stapo_megatron.rollout.config import RolloutConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _SeededSampler:
    """Logits processor that samples each row from its own generator and records log-probs.

    Returns scores that are 0 at the chosen token and -inf elsewhere, so ``generate``'s greedy
    step picks exactly the token chosen here.
    """

    def __init__(self, generators: list, temperature: float, top_p: float):
        self.generators, self.temperature, self.top_p = generators, temperature, top_p
        self.tokens, self.logprobs = [], []

    def __call__(self, input_ids: torch.Tensor, scores_BV: torch.Tensor) -> torch.Tensor:
        z_BV = scores_BV.float()
        if self.temperature == 0:
            y_B = z_BV.argmax(-1)
            logp_BV = torch.log_softmax(z_BV, -1)
        else:
            logp_BV = torch.log_softmax(z_BV / self.temperature, -1)
            if self.top_p < 1:
                logp_BV = _top_p(logp_BV, self.top_p)
            # drawn on the CPU: the same noise on any device, so a CUDA run samples what the CPU does
            gumbel_BV = torch.stack([
                -torch.empty(logp_BV.shape[-1]).exponential_(generator=g).log() for g in self.generators
            ]).to(logp_BV.device)
            y_B = (logp_BV + gumbel_BV).argmax(-1)
        self.tokens.append(y_B)
        self.logprobs.append(logp_BV.gather(-1, y_B[:, None])[:, 0])
        out_BV = torch.full_like(scores_BV, float("-inf"))
        return out_BV.scatter_(-1, y_B[:, None], 0.0)


def _top_p(logp_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-probable set with mass >= top_p (at least one token); renormalise."""
    sorted_BV, order_BV = logp_BV.sort(-1, descending=True)
    mass_before_BV = sorted_BV.exp().cumsum(-1) - sorted_BV.exp()
    drop_BV = torch.zeros_like(mass_before_BV, dtype=torch.bool).scatter_(-1, order_BV, mass_before_BV >= top_p)
    return torch.log_softmax(logp_BV.masked_fill(drop_BV, float("-inf")), -1)


_ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
"""Module name of a Qwen3-MoE router (the layer index is group 1)."""
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
"""Name of a fused in-memory expert parameter (transformers 5 MoE layers)."""


def _param_slots(model) -> dict:
    """HF checkpoint name -> (tensor to copy into, key of the piece it fills).

    Plain parameters are their own piece (a tied lm_head names the embedding's piece again);
    fused expert parameters are cut into one piece per expert and projection.
    """
    slots = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fused = _FUSED_EXPERTS.match(name)
        if fused is None:
            slots[name] = (p, (id(p),))
            continue
        prefix, kind = fused.groups()
        for e in range(p.shape[0]):
            if kind == "down_proj":
                slots[f"{prefix}.{e}.down_proj.weight"] = (p[e], (id(p), e))
            else:  # [2I, H]: the gate projection's I rows, then the up projection's
                half = p.shape[1] // 2
                slots[f"{prefix}.{e}.gate_proj.weight"] = (p[e, :half], (id(p), e, "gate"))
                slots[f"{prefix}.{e}.up_proj.weight"] = (p[e, half:], (id(p), e, "up"))
    return slots


class _RouteRecorder:
    """Forward hooks on the MoE routers recording the top-k experts of every forward.

    ``calls[l]`` holds layer l's ``[B, T_call, K]`` indices per forward (the prefill's T is the
    padded prompt width, each decode step's 1), in call order.
    """

    def __init__(self, model, batch_rows: int):
        self.rows = batch_rows
        routers = sorted(((int(m.group(1)), mod) for name, mod in model.named_modules()
                          if (m := _ROUTER.search(name))), key=lambda x: x[0])
        self.calls = [[] for _ in routers]
        self.handles = [mod.register_forward_hook(self._hook(i)) for i, (_, mod) in enumerate(routers)]

    def _hook(self, index: int):
        def record(module, args, output):
            indices = output[2]  # (router logits, top-k weights, top-k indices [B*T, K])
            self.calls[index].append(indices.detach().view(self.rows, -1, indices.shape[-1]).cpu())
        return record

    def routes_BTLK(self) -> Optional[torch.Tensor]:
        """All forwards' indices ``[B, T, L, K]`` (T = prompt width + decode steps); None for a
        dense model."""
        for h in self.handles:
            h.remove()
        if not self.calls:
            return None
        return torch.stack([torch.cat(layer, dim=1) for layer in self.calls], dim=2)


class HFEngine:
    """transformers ``generate`` with the `VLLMEngine` interface; see the module docstring."""

    capabilities = EngineCapabilities(partial_continuation=True, router_replay=True)
    """No streaming: ``generate`` runs a whole batch (transformers has no request API)."""

    def __init__(self, hf_dir: str, config: RolloutConfig):
        """Load the HF model (``config.load_format`` "dummy": config only, random weights, for
        when `sync_weights` runs before the first ``generate``) on this rank's device."""
        import transformers

        if not os.path.isfile(os.path.join(hf_dir, "config.json")):
            raise FileNotFoundError(f"no config.json in {hf_dir} (the engine needs an HF model folder)")
        if config.dtype != "auto" and config.dtype not in _DTYPES:
            raise ValueError(f"RolloutConfig.dtype must be 'auto' or one of {sorted(_DTYPES)}, got {config.dtype!r}")
        if config.tensor_parallel_size != 1:
            raise ValueError(f"the HF engine has no tensor parallelism (tensor_parallel_size {config.tensor_parallel_size})")
        self.config = config
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        dtype = _DTYPES.get(config.dtype, "auto")
        if config.load_format == "dummy":
            hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=None if dtype == "auto" else dtype)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = self.model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        # A folder's generation_config.json (Qwen's: top_k 20, repetition_penalty 1.05, ...) would
        # add logits processors; sampling is entirely `_SeededSampler`'s.
        self.model.generation_config = transformers.GenerationConfig(
            eos_token_id=sorted(self.eos_ids) or None, pad_token_id=self.pad_id)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir) if has_tokenizer(hf_dir) else None
        self._rng = torch.Generator().manual_seed(config.seed)

    def generate(self, prompt_token_ids: list[list[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: Optional[Union[int, Sequence[int]]] = None) -> list[list[Sample]]:
        """Sample ``n`` responses for each prompt (arguments and seeds as `VLLMEngine.generate`)."""
        if not prompt_token_ids:
            return []
        check_generate_args(prompt_token_ids, n, temperature, top_p, max_tokens)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._rng))
        firsts = prompt_seeds(seed, len(prompt_token_ids), n)
        rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(n)]
        samples = []
        for start in range(0, len(rows), self.config.hf_max_batch_size):
            chunk = rows[start : start + self.config.hf_max_batch_size]
            samples += self._generate_rows([prompt_token_ids[i] for i, _ in chunk],
                                           [firsts[i] + j for i, j in chunk], temperature, top_p, max_tokens)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    def _generate_rows(self, prompts, seeds, temperature, top_p, max_tokens) -> list[Sample]:
        from transformers import LogitsProcessorList

        width = max(len(p) for p in prompts)
        # left padding: every row's next token is at the same (last) position
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        generators = [torch.Generator().manual_seed(s) for s in seeds]  # CPU generators (`_SeededSampler`)
        sampler = _SeededSampler(generators, temperature, top_p)
        recorder = _RouteRecorder(self.model, len(prompts)) if self.config.return_routed_experts else None
        try:
            self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, logits_processor=LogitsProcessorList([sampler]),
                do_sample=False, num_beams=1, max_new_tokens=max_tokens, min_new_tokens=0,
            )
        finally:
            routes_BTLK = recorder.routes_BTLK() if recorder is not None else None
        tokens_BT = torch.stack(sampler.tokens, -1).tolist()
        logprobs_BT = torch.stack(sampler.logprobs, -1).tolist()
        samples = [self._to_sample(t, lp) for t, lp in zip(tokens_BT, logprobs_BT)]
        if routes_BTLK is not None:
            for b, (prompt, sample) in enumerate(zip(prompts, samples)):
                # row b's prompt starts after its left padding; the last sampled token is never forwarded
                pad = width - len(prompt)
                sample.routed_experts = routes_BTLK[b, pad : width + len(sample.token_ids) - 1].clone()
        return samples

    def _to_sample(self, tokens: list[int], logprobs: list[float]) -> Sample:
        end = next((k + 1 for k, t in enumerate(tokens) if t in self.eos_ids), None)
        finish = "stop" if end is not None else "length"
        tokens, logprobs = tokens[:end], logprobs[:end]
        return Sample(token_ids=tokens, logprobs=logprobs, text=self.detokenize(tokens), finish_reason=finish)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of response tokens, as ``Sample.text`` ("" without a tokenizer)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy streamed HF ``(name, tensor)`` pairs into the model; every parameter (every
        expert of a fused MoE parameter) must come."""
        slots = _param_slots(self.model)  # tied lm_head too
        loaded = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in slots:
                    raise ValueError(f"the HF model has no parameter {name!r}")
                target, piece = slots[name]
                if target.shape != tensor.shape:
                    raise ValueError(f"{name}: HF shape {tuple(target.shape)}, streamed {tuple(tensor.shape)}")
                target.copy_(tensor)
                loaded.add(piece)
        missing = sorted({piece: n for n, (_, piece) in slots.items() if piece not in loaded}.values())
        if missing:
            raise ValueError(f"weight update did not provide {missing}")

    def sleep(self) -> None:
        """No-op (the HF engine keeps its weights; it has no KV cache between calls)."""

    def wake_up(self, tags=None) -> None:
        """No-op (see `sleep`)."""

    def shutdown(self) -> None:
        """Drop the model."""
        self.model = None
