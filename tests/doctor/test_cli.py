"""Tier a: stapo-doctor's command line refuses an unknown check and names the device it ran on. (Its rows are tested per module;
its CPU subset end to end in ``tests/integration/test_doctor.py``.)"""


def test_unknown_check_is_a_usage_error(capsys):
    from stapo_megatron.doctor.cli import main

    assert main(["--only", "nccl"]) == 2
    assert "unknown check 'nccl'" in capsys.readouterr().err


def test_the_report_names_the_device(capsys):
    """The first line of the table and ``device`` in the JSON: ``torch.cuda.get_device_name()``, or
    ``cpu`` on a machine without CUDA (the versions row alone: no process group, no model)."""
    import json

    import torch

    from stapo_megatron.doctor.cli import device_name, main

    want = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    assert device_name() == want
    assert main(["--only", "versions"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"device: {want}" and lines[1].split() == ["check", "status", "time", "detail"]
    assert lines[2].startswith("versions ") and lines[-1] == "1 passed, 0 failed, 0 skipped"
    assert main(["--only", "versions", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == want and [c["name"] for c in report["checks"]] == ["versions"]
