"""LoRA adapters on Megatron-Core's tensor-parallel linears, placed the way the base is sharded.

Each targeted linear (`lora_config.LoraConfig`) keeps its weight W0, frozen, and gains an adapter
whose output is added to the base output: y = W0 x + (alpha / r) B A x (Hu et al. 2021, eq. 3),
with B zero at the start, so the adapted model first computes exactly what the base computes.
The adapter is a child module ``lora`` of the base linear (parameters ``<linear>.lora.A`` and
``<linear>.lora.B``; the base's own names are unchanged) and a forward hook on the base adds its
output, so the base layer's forward runs as megatron-core wrote it, on any version.

Shapes (legend: s tokens, s/T of them per rank under sequence parallelism; b micro-batch; r rank;
T the linear's TP size; in / out the base's full dimensions):

- column-parallel base (``linear_qkv``, ``linear_fc1``; W0 is out/T x in on each rank):
  A r x in, replicated; B out/T x r, sharded like W0's rows (for a gated ``linear_fc1`` the rank's
  rows are its gate shard then its up shard, as W0's are).
- row-parallel base (``linear_proj``, ``linear_fc2``; W0 is out x in/T): A r x in/T, sharded like
  W0's columns; B out x r, replicated.

Where the TP communication sits (only r-wide tensors move, never an in- or out-wide one):

- column: the base's input is replicated over TP, or, under sequence parallelism, split along s
  and gathered inside the base's forward (megatron-core's ColumnParallelLinear passes
  ``sequence_parallel`` to its matmul, which all-gathers x and reduce-scatters dx). The adapter
  makes the same pair on r-wide h instead of x (A acts on each token alone): h = A x on its own
  tokens, then gathered over the sequence (SP; backward: reduce-scatter) or passed through
  ``copy_to_tensor_model_parallel_region`` (backward: all-reduce). Either way dh, which each rank
  holds only for its B shard's outputs, is summed over TP in the backward, so A's gradient and
  the gradient into x are complete without touching the base's own input communication. Under
  SP each rank's A gradient covers its own s/T tokens: A is marked ``sequence_parallel`` and
  Megatron's ``finalize_model_grads`` all-reduces it over TP, as it does the layer norms.
- row: the rank's partial product h = A_shard x_shard is reduced by the adapter itself (all-reduce;
  under SP reduce-scatter along s, matching the base's output) before the replicated B. The
  base's all-reduce cannot carry it without rewriting the base's forward; the adapter's reduce is
  r / out of the base's, and keeps B's gradient complete on every rank (under SP it covers the
  rank's s/T tokens: B is marked ``sequence_parallel``, as A is for column adapters).

Dropout on the adapter input follows Megatron's RNG rule: an input split over TP (row adapters;
column adapters under SP) draws its mask from the model-parallel RNG (different per TP rank), a
replicated input from the default RNG (the same mask on every TP rank, as its replicas need).
"""

from __future__ import annotations

import contextlib
import math
import re
import types
import warnings
import zlib
from typing import Dict, Iterator, List, Mapping, Sequence, Tuple

import torch

from stapo_megatron.mcore.lora_config import LoraConfig

COLUMN_TARGETS = ("linear_qkv", "linear_fc1")
"""The targets whose base is megatron-core's ColumnParallelLinear."""
ROW_TARGETS = ("linear_proj", "linear_fc2")
"""The targets whose base is megatron-core's RowParallelLinear."""


def shard_rows(full: torch.Tensor, rank: int, size: int, glu: bool = False) -> torch.Tensor:
    """Rank ``rank``'s rows of a column-parallel output dimension split ``size`` ways; ``glu``: the
    rows are [gate; up] and each rank holds [gate shard; up shard] (megatron-core's gated MLP)."""
    if glu:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return full.chunk(size, dim=0)[rank]


def unshard_rows(shards: Sequence[torch.Tensor], glu: bool = False) -> torch.Tensor:
    """The inverse of `shard_rows`: the full rows from every rank's shard, in rank order."""
    if glu:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(list(shards))


class LoraAdapter(torch.nn.Module):
    """The adapter of one parallel linear: parameters ``A`` and ``B`` (this rank's shards, see the
    module docstring), the scaling ``alpha / r`` and an ``enabled`` switch (`adapters_disabled`)."""

    def __init__(self, base: torch.nn.Module, parallel: str, config: LoraConfig, glu: bool, init_key: str):
        super().__init__()
        assert parallel in ("column", "row"), parallel
        self.parallel = parallel
        self.tp_group = base.tp_group
        self.tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        # Expert linears with explicit expert communication run unsharded (expert-TP 1, apply_lora
        # refuses more), whatever config.sequence_parallel says.
        self.sequence_parallel = bool(base.sequence_parallel) and self.tp_size > 1
        self.glu = glu
        self.scaling = config.scaling
        self.enabled = True
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout > 0 else None
        self.full_shapes = ((config.rank, base.input_size), (base.output_size, config.rank))  # A's, B's, unsharded
        # A: PEFT's kaiming-uniform (a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn at full size
        # from a generator keyed by the adapter's place, then sharded: the same A at any layout.
        gen = torch.Generator().manual_seed(zlib.crc32(f"{config.seed}:{init_key}".encode()))
        bound = 1.0 / math.sqrt(base.input_size)
        a_full = (torch.rand(self.full_shapes[0], generator=gen, dtype=torch.float64) * 2 - 1) * bound
        b_full = torch.zeros(self.full_shapes[1], dtype=torch.float64)
        a_local, b_local = self._shard(a_full, b_full)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.A = torch.nn.Parameter(a_local.to(**like))
        self.B = torch.nn.Parameter(b_local.to(**like))
        self._set_parallel_attributes(base)

    def _set_parallel_attributes(self, base: torch.nn.Module) -> None:
        """The attributes Megatron reads off parameters: ``tensor_model_parallel`` (grad-norm and
        checkpoint sharding), ``sequence_parallel`` (TP all-reduce in ``finalize_model_grads``),
        ``allreduce`` (False: an expert parameter, reduced over expert-DP by Megatron's DDP)."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        sharded, replicated, dim = (self.B, self.A, 0) if self.parallel == "column" else (self.A, self.B, 1)
        set_tensor_model_parallel_attributes(sharded, is_parallel=self.tp_size > 1, dim=dim, stride=1)
        set_tensor_model_parallel_attributes(replicated, is_parallel=False, dim=-1, stride=1)
        replicated.sequence_parallel = self.sequence_parallel
        sharded.sequence_parallel = False
        for p in (self.A, self.B):
            p.allreduce = getattr(base.weight, "allreduce", True)

    def _shard(self, a_full: torch.Tensor, b_full: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.parallel == "column":
            return a_full, shard_rows(b_full, self.tp_rank, self.tp_size, self.glu)
        return a_full.chunk(self.tp_size, dim=1)[self.tp_rank], b_full

    @torch.no_grad()
    def load_full_(self, a_full: torch.Tensor, b_full: torch.Tensor) -> None:
        """Set A and B from their full (unsharded) values, keeping this rank's shards."""
        if (tuple(a_full.shape), tuple(b_full.shape)) != self.full_shapes:
            raise ValueError(f"LoRA weights of shapes A {tuple(a_full.shape)}, B {tuple(b_full.shape)}; this adapter "
                             f"takes A {self.full_shapes[0]}, B {self.full_shapes[1]}")
        a_local, b_local = self._shard(a_full, b_full)
        self.A.copy_(a_local)
        self.B.copy_(b_local)

    def gather_full(self, a_local: torch.Tensor, b_local: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The full values of tensors laid out like this rank's A and B (the weights, their
        gradients): a collective over the adapter's TP group, every rank of it must call."""
        if self.tp_size == 1:
            return a_local, b_local
        sharded = b_local if self.parallel == "column" else a_local
        shards = [torch.empty_like(sharded) for _ in range(self.tp_size)]
        torch.distributed.all_gather(shards, sharded.contiguous(), group=self.tp_group)
        if self.parallel == "column":
            return a_local, unshard_rows(shards, self.glu)
        return torch.cat(shards, dim=1), b_local

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is None:
            return x
        split = self.tp_size > 1 and (self.parallel == "row" or self.sequence_parallel)
        if not split:
            return self.dropout(x)
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.dropout(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's output for the base's input ``x`` (s or s/T, b, in or in/T), laid out as
        the base's output: column (s, b, out/T), row (s or s/T, b, out)."""
        from megatron.core.tensor_parallel import mappings

        h = torch.nn.functional.linear(self._dropout(x), self.A) * self.scaling  # (s or s/T, b, r)
        if self.tp_size > 1 and self.parallel == "column":
            if self.sequence_parallel:  # gather the tokens; backward: reduce-scatter dh over TP
                h = mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True,
                                                                  group=self.tp_group)
            else:  # backward: all-reduce dh (each rank's B shard sees part of the outputs)
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.tp_size > 1:  # row: each rank holds A_shard x_shard, a partial sum
            if self.sequence_parallel:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
            else:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return torch.nn.functional.linear(h, self.B)


def _sharded_state_dict(base, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
    """An adapted linear's ``sharded_state_dict``: the base's, whose maker marks every key but
    ``weight`` and ``bias`` replicated over TP, with the adapter's sharded parameter (column B,
    row A) marked TP-sharded, and a gated ``linear_fc1``'s B split as its weight is (gate and up
    shards apart), so a checkpoint of the adapted model reshards across TP like the base's."""
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    out = type(base).sharded_state_dict(base, prefix, sharded_offsets, metadata)
    adapter = base.lora
    if adapter.tp_size == 1:
        return out
    name, axis = ("B", 0) if adapter.parallel == "column" else ("A", 1)
    key = f"{prefix}lora.{name}"
    out[key] = make_tp_sharded_tensor_for_checkpoint(getattr(adapter, name), key, axis,
                                                     prepend_offsets=sharded_offsets)
    if adapter.glu:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets)
    return out


def _add_adapter_output(module, args, output):
    """Forward hook on an adapted base linear: its (output, bias) with the adapter's output added."""
    if not module.lora.enabled:
        return output
    out, bias = output
    return out + module.lora(args[0]), bias


_LAYER = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+)\.(?P<rest>.*)$")
_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.local_experts\.(?P<index>\d+)\.(?P<rest>.*)$")


def _init_key(model: torch.nn.Module, name: str) -> str:
    """The adapter's place independent of the parallel layout: the global layer number, the path
    inside the layer, and for an expert its global index (``name`` is the local module path)."""
    match = _LAYER.match(name)
    if match is None:
        return name
    layer_number = model.get_submodule(match["layer"]).layer_number
    rest = match["rest"]
    expert = _EXPERT.match(name)
    if expert is not None:
        experts = model.get_submodule(expert["experts"])
        global_index = experts.ep_group.rank() * experts.num_local_experts + int(expert["index"])
        rest = f"{expert['experts'][len(match['layer']) + 1:]}.{global_index}.{expert['rest']}"
    return f"layer{layer_number}.{rest}"


def _targets(model: torch.nn.Module, config: LoraConfig) -> List[Tuple[str, torch.nn.Module, str]]:
    """(name, base linear, "column" / "row") of every linear ``config`` targets; ValueError naming
    the field for a target that is not one of megatron-core's parallel linears or too narrow."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    out, skipped_experts = [], set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in config.target_modules:
            continue
        is_expert = ".experts." in f".{name}"
        if is_expert and not config.experts:
            skipped_experts.add(leaf)
            continue
        field = "lora.experts" if is_expert else "lora.target_modules"
        parallel, expected = (("column", ColumnParallelLinear) if leaf in COLUMN_TARGETS
                              else ("row", RowParallelLinear))
        if not isinstance(module, expected):
            raise ValueError(f"{field}: {name} is a {type(module).__name__}, not megatron-core's {expected.__name__}: "
                             f"LoRA adapters wrap the local layer spec's parallel linears (not transformer-engine's "
                             f"or grouped-GEMM experts)")
        if is_expert and module.tp_group.size() > 1:
            raise ValueError(f"lora.experts=True with expert-TP {module.tp_group.size()} ({name}): expert adapters "
                             f"need expert_tensor_parallel_size 1")
        smallest = min(module.input_size, module.output_size)
        if config.rank > smallest:
            raise ValueError(f"lora.rank {config.rank} is larger than {name}'s smaller dimension {smallest} "
                             f"(in {module.input_size}, out {module.output_size})")
        out.append((name, module, parallel))
    if not out:
        raise ValueError(f"lora.target_modules {config.target_modules}: the model has none of these linears")
    unmatched = [t for t in config.target_modules if t not in {name.rsplit(".", 1)[-1] for name, _, _ in out}]
    if unmatched:
        why = " (the experts' are adapted only with lora.experts=True)" if set(unmatched) <= skipped_experts else ""
        warnings.warn(f"lora.target_modules: the model has no {unmatched} to adapt{why}; those targets are skipped")
    return out


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> Dict[str, LoraAdapter]:
    """Freeze every parameter of ``model`` (a GPTModel, this rank's stage, before the DDP wrap)
    and add an adapter to each linear ``config`` targets; returns {base linear's name: adapter}.
    Build the optimizer afterwards: Megatron's takes only parameters that require a gradient."""
    if lora_adapters(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    targets = _targets(model, config)
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = {}
    for name, base, parallel in targets:
        glu = name.endswith("linear_fc1") and bool(base.config.gated_linear_unit)
        base.lora = LoraAdapter(base, parallel, config, glu, _init_key(model, name))
        base.register_forward_hook(_add_adapter_output)
        base.sharded_state_dict = types.MethodType(_sharded_state_dict, base)
        adapters[name] = base.lora
    return adapters


def lora_adapters(model: torch.nn.Module) -> Dict[str, LoraAdapter]:
    """{base linear's name: adapter} of every adapter in ``model`` (empty without LoRA)."""
    return {name[: -len(".lora")]: m for name, m in model.named_modules() if isinstance(m, LoraAdapter)}


def adapter_parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The adapters' parameters (A and B of every adapter): what an optimizer of a LoRA run holds."""
    return [p for adapter in lora_adapters(model).values() for p in (adapter.A, adapter.B)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as its frozen base (every adapter off, dropout included): the reference
    policy of a LoRA run, with no second copy of the weights. Restored on exit."""
    adapters = list(lora_adapters(model).values())
    if not adapters:
        raise ValueError("adapters_disabled: the model has no LoRA adapters (apply_lora)")
    states = [a.enabled for a in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states):
            adapter.enabled = state


@torch.no_grad()
def merged_weight(adapter: LoraAdapter, weight: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the merged weight W0 + (alpha / r) B A, in ``weight``'s dtype (the sum
    in float64). The shards multiply locally: a column adapter's B rows times the replicated A
    are the rows of the full B A that W0's shard holds, a row adapter's replicated B times its A
    columns the columns; so merging needs no communication."""
    delta = adapter.scaling * (adapter.B.double() @ adapter.A.double())
    return (weight.double() + delta).to(weight.dtype)


class MergedParameters(Mapping):
    """A model's parameters by name (``named_parameters``, detached), with the weight of every
    linear whose adapter is on merged with it (`merged_weight`) when read: what a rollout engine
    without LoRA support is sent (merge-on-sync). Each merge is computed when its name is read,
    so at most one merged shard exists at a time beside the model."""

    def __init__(self, model: torch.nn.Module):
        self._params = dict(model.named_parameters())
        self._adapters = {f"{name}.weight": a for name, a in lora_adapters(model).items() if a.enabled}

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = self._params[name].detach()
        adapter = self._adapters.get(name)
        return weight if adapter is None else merged_weight(adapter, weight)

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)
