"""The real launch entry (`entry.run_recipe`, tiny recipe with the ``lora`` section) on a
separately placed job, every weight transfer written down on both sides, for
tests/integration/test_lora_separate.py.

    torchrun --nproc-per-node N tests/helpers/lora_separate_script.py OUTPUT_DIR [key=value ...]

Into ``OUTPUT_DIR/transfers/``, one file per weight transfer in the queue's order:

- ``engine_<n>.pt`` (the engine rank): ``{HF or PEFT name: tensor}`` as the engine received it
  (the merged weights, or with ``rollout.engine=vllm_lora`` the base once and then the adapters);
- ``trainer_<n>.pt`` (trainer rank 0, as it starts the sync): ``expected``, the merged HF weights
  computed here apart from the sync's own merge (the base's HF tensors, adapters off, plus
  (alpha / r) B A of PEFT's per-projection adapters, in float64 rounded once), ``adapters`` (the
  PEFT tensors), ``base_hf`` (the base's HF tensors), ``base`` (the policy's frozen Megatron
  parameters) and ``bytes`` (what
  `weight_sync.sync_weights` reports it moved).
"""

import os
import sys

import torch

from stapo_megatron.launch import entry
from stapo_megatron.serve import server
from stapo_megatron.trainer import rollout_schedule
from tests.helpers.separate_script import SMALL, _merge


def _transfers(output_dir: str) -> str:
    path = os.path.join(output_dir, "transfers")
    os.makedirs(path, exist_ok=True)
    return path


def expected_transfer(model, hf_config, groups) -> dict:
    """What trainer rank 0 writes before a sync (module docstring); collective over the trainers."""
    from stapo_megatron.bridge.hf_config import spec_from_hf_config
    from stapo_megatron.bridge.peft import PEFT_PREFIX, peft_tensors
    from stapo_megatron.mcore.lora import adapters_disabled, lora_adapters
    from stapo_megatron.rollout.vllm_lora import full_adapters
    from stapo_megatron.rollout.weight_sync import _unwrap, iter_hf_weights

    gpt = _unwrap(model)
    with adapters_disabled(gpt):
        base_hf = {name: t.detach().to("cpu", copy=True) for name, t in iter_hf_weights(model, hf_config, groups)}
    adapters = peft_tensors(full_adapters(model, groups), spec_from_hf_config(hf_config))
    scaling = next(iter(lora_adapters(gpt).values())).scaling
    expected = dict(base_hf)
    for key, a in adapters.items():
        if key.endswith(".lora_A.weight"):
            module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
            b = adapters[f"{PEFT_PREFIX}{module}.lora_B.weight"]
            w0 = base_hf[f"{module}.weight"]
            expected[f"{module}.weight"] = (w0.double() + scaling * (b.double() @ a.double())).to(w0.dtype)
    base = {n: p.detach().to("cpu", copy=True) for n, p in gpt.named_parameters() if ".lora." not in n}
    return dict(expected=expected, base_hf=base_hf, adapters={k: v.to("cpu") for k, v in adapters.items()},
                base=base)


def _record_trainer_syncs(output_dir: str) -> None:
    """Trainer rank 0 writes ``trainer_<n>.pt`` at each sync (every trainer takes part)."""
    sync, count = rollout_schedule.sync_weights, [0]

    def recorded_sync(model, hf_config, groups, engine):
        record = expected_transfer(model, hf_config, groups)
        stats = sync(model, hf_config, groups, engine)
        if int(os.environ["RANK"]) == 0:
            record["bytes"] = stats["bytes"]
            torch.save(record, os.path.join(_transfers(output_dir), f"trainer_{count[0]:03d}.pt"))
        count[0] += 1
        return stats

    rollout_schedule.sync_weights = recorded_sync


def _record_engine_transfers(output_dir: str) -> None:
    """The engine rank writes ``engine_<n>.pt`` after each transfer it loaded."""
    load_transfer, count = server.load_transfer, [0]

    def recorded(load, *args, **kwargs):
        got = {}

        def load_recording(weights):
            def copies():
                for name, tensor in weights:
                    got[name] = tensor.detach().to("cpu", copy=True)
                    yield name, tensor
            return load(copies())

        load_transfer(load_recording, *args, **kwargs)
        torch.save(got, os.path.join(_transfers(output_dir), f"engine_{count[0]:03d}.pt"))
        count[0] += 1

    server.load_transfer = recorded


if __name__ == "__main__":
    output_dir = sys.argv[1]
    _record_trainer_syncs(output_dir)
    _record_engine_transfers(output_dir)
    entry.run_recipe("tiny", output_dir=output_dir, **_merge(SMALL, entry.parse_arguments(sys.argv[2:])))
