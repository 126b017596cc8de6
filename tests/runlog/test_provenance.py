"""Provenance and retention, single process: the configuration YAML round trip (what a dry run
writes and a launch reads back), the provenance record of a run folder, and `keep_last`."""

import dataclasses
import json
import os

import pytest

from stapo_megatron.mcore import checkpoint as ckpt
from stapo_megatron.config.yaml_io import dump_config, load_config, write_config
from stapo_megatron.runlog.provenance import PACKAGES, RunProvenance, collect, read_provenance
from stapo_megatron.recipes.tiny import tiny_demo


def test_run_provenance_files(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (hf / "tokenizer.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"weights")
    cfg, warmstart = tiny_demo(run_dir=str(tmp_path / "run"))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_dir=str(hf)))
    record = collect(["train.py", "steps=3"])
    assert set(record["packages"]) == set(PACKAGES) and record["packages"]["torch"]
    assert record["command"] == ["train.py", "steps=3"]
    assert len(record["git"]["commit"] or "x" * 40) == 40 and record["git"]["dirty"] in (True, False, None)

    prov = RunProvenance(dump_config(cfg, warmstart), cfg.run_dir, cfg.model.hf_dir, record)
    prov.write_run()
    prov.write_run()  # a resumed run keeps the earlier start
    stored = read_provenance(cfg.run_dir)
    assert stored["command"] == record["command"] and len(stored["previous"]) == 1
    assert load_config(os.path.join(cfg.run_dir, "config.yaml"))[1:] == load_config(
        write_config(str(tmp_path / "c.yaml"), cfg, warmstart))[1:]

    step = tmp_path / "step"
    step.mkdir()
    prov.write_checkpoint(str(step))
    assert sorted(os.listdir(step / "hf")) == ["config.json", "tokenizer.json"]  # no weights
    assert json.loads((step / "provenance.json").read_text())["packages"] == record["packages"]
    assert (step / "config.yaml").read_text() == (tmp_path / "run" / "config.yaml").read_text()


def _fake_checkpoint(root, step, complete=True):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    names = (".metadata", ckpt.TRAINER_STATE, "rng_rank00000.pt") if complete else (".metadata",)
    for name in names:
        (path / name).write_text("x")
    return path


def test_keep_last_keeps_the_newest_and_latest(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5):
        _fake_checkpoint(root, step)
    _fake_checkpoint(root, 6, complete=False)  # a save in progress
    (root / ckpt.LATEST).write_text("step_00000005\n")
    deleted = ckpt.prune_checkpoints(str(tmp_path), keep_last=2)
    assert [os.path.basename(d) for d in deleted] == ["step_00000001", "step_00000002", "step_00000003"]
    assert sorted(os.listdir(root)) == ["latest", "step_00000004", "step_00000005", "step_00000006"]

    # a stale `latest` (naming an older checkpoint) is kept besides the newest complete one
    (root / ckpt.LATEST).write_text("step_00000004\n")
    _fake_checkpoint(root, 7)
    assert ckpt.prune_checkpoints(str(tmp_path), keep_last=1) == []
    assert ckpt.find_latest(str(tmp_path), world_size=1).endswith("step_00000004")
    assert {"step_00000004", "step_00000007"} <= set(os.listdir(root))
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        ckpt.prune_checkpoints(str(tmp_path), keep_last=0)
