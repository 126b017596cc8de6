"""The optimizer's part of a training checkpoint, and the megatron-core gaps it works around.

`optimizer_sharded_state_dict` is what `stapo_megatron.mcore.checkpoint` saves and loads; it
names the distributed optimizer's sharding type (`OPTIMIZER_METADATA`) and stands in for
megatron-core where its optimizers cannot save or resume the models built here (megatron-core
0.16.1 - 0.19.2, each gap named at its function): a 16-bit optimizer over a model with fp32
parameters, and torch's Adam inside the distributed optimizer (the CPU; no Apex or Transformer
Engine). `restore_loaded_optimizer_state` finishes a loaded state before `load_state_dict`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

# How the distributed optimizer's state is laid out in a checkpoint. megatron-core (0.16 - 0.19)
# defaults to "fully_sharded_model_space", whose flattened ShardedTensors its own torch_dist
# saver then refuses ("ShardedTensor.flattened_range is not supported"). "dp_reshardable" is
# Megatron-LM's default: each rank writes its own buffers, with no gather, and the state loads at
# any DP size (at the TP/PP/EP it was saved with; the model weights load at any). The other
# optimizers ignore the setting. Saving and loading must pass the same value.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _float16_sharded_state_dict(opt, model_sharded_state_dict, is_loading: bool = False, **_):
    """`Float16OptimizerWithFloat16Params.sharded_state_dict` for a model whose parameters are
    not all bf16/fp16 (megatron-core 0.16.1 - 0.19.2, optimizer/optimizer.py).

    Upstream numbers the optimizer state by the 16-bit parameters alone and pairs each group's
    state ids with its fp32 master copies by position, so one fp32 parameter among them (the local
    spec's RMSNorm weights are always fp32) fails the save ("Param id N does not match any model
    sharded param") or would pair the wrong tensors. Here each state id is mapped to the model
    parameter it belongs to: the 16-bit parameter of a master copy, or the fp32 parameter itself.
    """
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, make_sharded_optimizer_tensor, optim_state_to_sharding_state)

    if is_loading:
        opt.init_state_fn(opt.optimizer, opt.config)
    state_dict = opt.state_dict()
    # each master copy's 16-bit parameter by the optimizer's own pairing of its groups, not the
    # parameter's ``main_param`` attribute: a second optimizer built over the same model (the
    # warm-start's) sets that attribute to its own copies
    model_param_of = {id(main): p for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups)
                      for p, main in zip(model_group, main_group)}
    inner = [p for group in opt.optimizer.param_groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, [model_param_of.get(id(p), p) for p in inner])
    state_ids = [pid for group in state_dict["optimizer"]["param_groups"] for pid in group["params"]]
    master_ids = {id(p): pid for p, pid in zip(inner, state_ids)}
    # a dict of the groups that have 16-bit parameters: dist_checkpointing's list handling
    # (dict_utils.extract_matching_values) shifts the groups after an empty one (a group of fp32
    # parameters only); `_master_groups_as_lists` turns it back into a list after the load
    state_dict["fp32_from_fp16_params"] = {
        i: [make_sharded_optimizer_tensor(id_map[master_ids[id(main)]], saved, prefix="optimizer.state.fp32_param")
            for main, saved in zip(main_group, saved_group)]
        for i, (main_group, saved_group) in enumerate(zip(opt.fp32_from_float16_groups,
                                                          state_dict["fp32_from_fp16_params"])) if main_group
    }
    step = opt._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], id_map, exclude_keys="step")
    if step:  # one step shared by every parameter, as upstream saves it
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


def _master_groups_as_lists(state: Any) -> None:
    """Undo `_float16_sharded_state_dict`'s dict of master-weight groups in a loaded optimizer
    state (at any depth: a `ChainedOptimizer`'s members sit under their indices)."""
    if not isinstance(state, dict):
        return
    masters = state.get("fp32_from_fp16_params")
    if isinstance(masters, dict):
        state["fp32_from_fp16_params"] = [masters.get(i, []) for i in range(len(state["optimizer"]["param_groups"]))]
    for value in state.values():
        _master_groups_as_lists(value)


def _set_steps(tree: Any, step: float) -> None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == "step" and torch.is_tensor(value):
                tree[key] = torch.tensor(float(step))
            else:
                _set_steps(value, step)
    elif isinstance(tree, list):
        for value in tree:
            _set_steps(value, step)


def _adam_steps_from_param_groups(state: Any) -> None:
    """Give a loaded distributed-optimizer state's per-parameter Adam steps the saved step.

    With torch's Adam the "step" of each parameter's entry in ``param_state`` ("dp_reshardable")
    is not a sharded tensor and comes back as the loading template's value (0 from
    `_give_fresh_adam_state`), and megatron-core copies it over the step that
    ``load_state_dict`` had restored from the param groups (0.16.1 - 0.19.2,
    distrib_optimizer.load_parameter_state_from_dp_reshardable): Adam's bias correction would
    restart. The param groups hold the saved step.
    """
    if not isinstance(state, dict):
        return
    if "param_state" in state and isinstance(state.get("optimizer"), dict):
        steps = {g.get("step") for g in state["optimizer"].get("param_groups", [])} - {None}
        if len(steps) == 1:
            _set_steps(state["param_state"], steps.pop())
    for value in state.values():
        _adam_steps_from_param_groups(value)


def _give_fresh_adam_state(optimizer) -> None:
    """Zero Adam state (moments and step 0) for each distributed optimizer that has taken no step
    yet, so that a resume can load into it; the loaded values replace them.

    megatron-core 0.16.1 - 0.19.2 (optimizer/distrib_optimizer.py, `state_dict`): with torch's
    Adam (no Apex or Transformer Engine, as on the CPU) the distributed optimizer reads the step
    from the per-parameter state, and a fresh optimizer has none (``assert len(steps) == 1``).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(opt, DistributedOptimizer) and isinstance(inner, torch.optim.Adam) and not inner.state:
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                          step=torch.tensor(0.0))


def optimizer_sharded_state_dict(optimizer, model_sd, is_loading: bool):
    """The optimizer's sharded state dict (`OPTIMIZER_METADATA`), with `_float16_sharded_state_dict`
    standing in, for this call only, for each 16-bit optimizer that also holds fp32 parameters
    (a `ChainedOptimizer` asks its members, so the member's method is replaced)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    mixed = [opt for opt in getattr(optimizer, "chained_optimizers", [optimizer])
             if isinstance(opt, Float16OptimizerWithFloat16Params) and any(opt.fp32_from_fp32_groups)]
    for opt in mixed:
        opt.sharded_state_dict = partial(_float16_sharded_state_dict, opt)
    if is_loading:
        _give_fresh_adam_state(optimizer)
    try:
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))
    finally:
        for opt in mixed:
            del opt.sharded_state_dict


def restore_loaded_optimizer_state(state: Any) -> None:
    """Put a loaded optimizer state (``dist_checkpointing.load``'s "optimizer" part) back into
    the form megatron-core's ``load_state_dict`` reads."""
    _master_groups_as_lists(state)
    _adam_steps_from_param_groups(state)


def unshare_adam_steps(optimizer) -> None:
    """Give every parameter's Adam state its own ``step`` tensor after a distributed optimizer's
    ``load_state_dict``.

    megatron-core 0.16.1 - 0.19.2 (optimizer/distrib_optimizer.py, ``load_state_dict`` without
    Apex or Transformer Engine, as on the CPU) puts one step tensor into every parameter's state;
    torch's Adam then increments it in place once per parameter, so the first step after a
    resume counts N steps for N parameters and Adam's bias correction jumps (measured: step 21
    instead of 3 for the tiny model's 19 parameters)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
