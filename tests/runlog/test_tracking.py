"""Tier a: experiment tracking with the real packages in their offline/local modes.

A run logs through `RunLogger` into W&B (offline) and MLflow (a local file store), is closed as a
killed run would be restarted, and resumes in the same run folder: what was written is read back
(W&B's offline transaction log with its own protobuf records, MLflow's store with MlflowClient)
and the resumed run continues the same tracking run (same id).
"""

import glob
import json
import os
import re
import struct

import pytest

from stapo_megatron.config import TrainerConfig
from stapo_megatron.runlog.config import LoggingConfig
from stapo_megatron.runlog.metrics import RunLogger
from stapo_megatron.config.overrides import apply_overrides
from stapo_megatron.runlog.tracking import read_run_ids

SAMPLES = [dict(prompt=f"{i}+1=", response=f"\\boxed{{{i + 1}}}", answer=str(i + 1), reward=1.0) for i in range(3)]


def _killed_then_resumed(run_dir, backend):
    """Steps 1-3 and an eval at 2, killed; resumed from the step-2 checkpoint, steps 3-4.
    Returns the tracking run id of each of the two processes."""
    cfg = LoggingConfig(backends=(backend,), project="stapo-test", num_samples=2)
    ids = []
    for steps, resume in (((1, 2, 3), None), ((3, 4), 2)):
        logger = RunLogger(str(run_dir), logging=cfg, config=TrainerConfig(run_dir=str(run_dir), logging=cfg))
        if resume is not None:
            logger.resume_from(resume)
        for step in steps:
            logger.log({"kind": "train", "step": step, "loss": float(step), "tau_h": float("nan")})
            logger.log_silenced(step, [(5, -7.0, 0.2, 1.0)], lambda t: f"<{t}>")
            if step == 2:
                logger.log({"kind": "eval", "step": 2, "eval_accuracy": 0.5})
                logger.log_samples(2, SAMPLES)
        ids.append(read_run_ids(str(run_dir))[backend])
        logger.close()
        if backend == "wandb":
            import wandb

            # a resumed run is a new process: W&B's service process starts afresh too, as it would
            wandb.teardown()
    return ids


def _wandb_records(path):
    """The records of a W&B offline run file: a LevelDB-style log (32 KiB blocks, 7-byte chunk
    headers: crc32c, length, type) after a 7-byte W&B header, each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_history(run_file):
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "history"]


def test_wandb_offline_run_is_written_and_resumed_under_the_same_id(tmp_path, monkeypatch):
    # what this test does not look at and costs seconds per run: system stats, metadata, pip freeze
    for name in ("WANDB_X_DISABLE_STATS", "WANDB_X_DISABLE_META", "WANDB_X_DISABLE_MACHINE_INFO"):
        monkeypatch.setenv(name, "true")
    monkeypatch.setenv("WANDB_X_SAVE_REQUIREMENTS", "false")
    first_id, resumed_id = _killed_then_resumed(tmp_path, "wandb")
    assert first_id == resumed_id
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    # `wandb sync` appends both; a resume within the same second as the first run's start gets
    # the folder name with "-1" appended (wandb avoids the collision), which sorts after it
    assert len(runs) == 2 and all(re.search(f"-{first_id}(-\\d+)?$", r) for r in runs), runs
    history = [_wandb_history(os.path.join(r, f"run-{first_id}.wandb")) for r in runs]
    losses = [[(h["step"], h["train/loss"]) for h in part if "train/loss" in h] for part in history]
    assert losses == [[(1, 1.0), (2, 2.0), (3, 3.0)], [(3, 3.0), (4, 4.0)]]
    assert not any("train/tau_h" in h for part in history for h in part)  # NaN is left out
    assert [(h["step"], h["eval/eval_accuracy"]) for h in history[0] if "eval/eval_accuracy" in h] == [(2, 0.5)]
    samples = [h for h in history[0] if "eval/samples/path" in h]
    assert [h["step"] for h in samples] == [2] and samples[0]["eval/samples/nrows"] == 2
    with open(os.path.join(runs[0], "files", samples[0]["eval/samples/path"])) as f:
        table = json.load(f)
    assert table["columns"] == ["prompt", "response", "answer", "reward"]
    assert table["data"] == [[s["prompt"], s["response"], s["answer"], s["reward"]] for s in SAMPLES[:2]]
    silenced = [h for h in history[0] if "eval/silenced_tokens/path" in h]
    with open(os.path.join(runs[0], "files", silenced[0]["eval/silenced_tokens/path"])) as f:
        # the last column: grad_norm_mean (None: the logged rows carry no gradient norm)
        assert json.load(f)["data"] == [["<5>", 1, pytest.approx(2.718281828 ** -7), None, 0.2, 1.0, 0, None]]


def test_mlflow_file_store_is_written_and_resumed_under_the_same_run(tmp_path):
    first_id, resumed_id = _killed_then_resumed(tmp_path, "mlflow")
    assert first_id == resumed_id
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file://" + str(tmp_path / "mlruns"))
    run = client.get_run(first_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert client.get_experiment(run.info.experiment_id).name == "stapo-test"
    assert run.data.params["loss.tau_p"] == "0.002" and run.data.params["logging.project"] == "stapo-test"
    history = sorted((m.step, m.value) for m in client.get_metric_history(first_id, "train/loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 3.0), (4, 4.0)]  # step 3 logged again after resume
    assert [(m.step, m.value) for m in client.get_metric_history(first_id, "eval/eval_accuracy")] == [(2, 0.5)]
    assert client.get_metric_history(first_id, "train/tau_h") == []  # NaN is left out
    table = json.loads(open(client.download_artifacts(first_id, "eval/samples/step_000002.json", str(tmp_path))).read())
    assert table == {"columns": ["prompt", "response", "answer", "reward"],
                     "data": [[s["prompt"], s["response"], s["answer"], s["reward"]] for s in SAMPLES[:2]]}
    # the run folder's own logs: samples.jsonl keeps the eval before the resume point
    with open(tmp_path / "samples.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [2]


def test_backends_from_the_command_line_form():
    cfg = apply_overrides(TrainerConfig(), {"logging.backends": "[tensorboard,wandb,mlflow]", "logging.run_name": "x"})
    assert cfg.logging.backends == ("tensorboard", "wandb", "mlflow") and cfg.logging.run_name == "x"
    assert LoggingConfig(backends="wandb").backends == ("wandb",)
    assert LoggingConfig(backends=[]).backends == ()
    with pytest.raises(ValueError, match=r"logging.backends: unknown \['neptune'\]; choose from"):
        LoggingConfig(backends="tensorboard,neptune")
    with pytest.raises(ValueError, match="logging.wandb_mode must be 'offline' or 'online'"):
        LoggingConfig(wandb_mode="disabled")
