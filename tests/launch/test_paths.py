"""Tier a: every path a job reads or writes that no container mount holds is named, with the
mounts it has."""

import pytest

pytest.importorskip("nemo_run")

from stapo_megatron.launch import paths  # noqa: E402


def test_paths_outside_every_mount_are_named():
    read = [("model.hf_dir", "/lustre/models/q"), ("data.train_path", "/scratch/d.parquet"),
            ("data.eval_path", "/nemo_run/aime.jsonl"), ("config", "relative.yaml")]
    problems = paths.mount_problems(read, "/home/me/run", ["/lustre:/lustre", "/data/hf:/hf:ro"])
    assert len(problems) == 2, problems
    assert problems[0].startswith("data.train_path='/scratch/d.parquet' is not under a folder mounted into the "
                                  "container, so the job would not find it: add its folder to STAPO_CONTAINER_MOUNTS")
    assert problems[1].startswith("output_dir '/home/me/run' is not under a folder mounted into the container: "
                                  "the checkpoints would go to the container's temporary file system")
    assert "mounts now: /lustre:/lustre, /data/hf:/hf:ro" in problems[1]
    assert paths.mount_problems(read[:1], "/lustre/run", ["/lustre"]) == []
