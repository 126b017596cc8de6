"""examples/demo_lora_seeds.py: the demo-lora table and its sentence come from the runs' numbers, and
the checkpoint column is the size of the newest checkpoint folder."""

import importlib.util
import os
from tests.helpers import REPO_DIR


def _script():
    spec = importlib.util.spec_from_file_location("demo_lora_seeds",
                                                  os.path.join(REPO_DIR, "examples", "demo_lora_seeds.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(start, end, silenced=100, diff=3e-7, ckpt=7_500_000, seconds=300.0):
    return dict(start=start, end=end, silenced=silenced, logprob_diff=diff, ckpt=ckpt, seconds=seconds)


def test_table_has_a_row_per_seed_and_method_and_the_means():
    script = _script()
    results = [(1, dict(full=_run(0.5, 0.75), lora=_run(0.5, 0.79, silenced=80, ckpt=1_400_000))),
               (2, dict(full=_run(0.5, 0.70, seconds=0.0), lora=_run(0.5, 0.60, silenced=60)))]
    rows = script.table(results).splitlines()
    assert rows[2] == "| 1 | full | 0.500 | 0.750 | +0.250 | 100 | 3.0e-07 | 7.50 MB | 5.0 min |"
    assert rows[3] == "| 1 | lora | 0.500 | 0.790 | +0.290 | 80 | 3.0e-07 | 1.40 MB | 5.0 min |"
    assert rows[4].endswith("| not recorded |")
    assert rows[6] == "| mean | full | 0.500 | 0.725 | +0.225 | 100.0 | | | |"
    assert rows[7] == "| mean | lora | 0.500 | 0.695 | +0.195 | 70.0 | | | |"
    assert script.verdict(results) == ("LoRA's held-out accuracy rose on 2 of 2 seeds (1, 2); its gain was at "
                                       "least full fine-tuning's on 1 of 2.")


def test_a_seed_where_lora_did_not_learn_is_not_counted():
    script = _script()
    results = [(7, dict(full=_run(0.5, 0.7), lora=_run(0.5, 0.5)))]
    assert script.verdict(results).startswith("LoRA's held-out accuracy rose on 0 of 1 seeds;")


def test_checkpoint_bytes_reads_the_newest_step(tmp_path):
    script = _script()
    assert script.checkpoint_bytes(str(tmp_path)) == 0  # no checkpoints folder
    for step, size in ((20, 10), (100, 7)):  # step 100 sorts before step 20 as text
        folder = tmp_path / "checkpoints" / f"step_{step:08d}" / "model"
        folder.mkdir(parents=True)
        (folder / "shard").write_bytes(b"x" * size)
    (tmp_path / "checkpoints" / "latest").write_text("100")
    assert script.checkpoint_bytes(str(tmp_path)) == 7
