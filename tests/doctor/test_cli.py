"""Tier a: stapo-doctor's command line refuses an unknown check. (Its rows are tested per module;
its CPU subset end to end in ``tests/integration/test_doctor.py``.)"""


def test_unknown_check_is_a_usage_error(capsys):
    from stapo_megatron.doctor.cli import main

    assert main(["--only", "nccl"]) == 2
    assert "unknown check 'nccl'" in capsys.readouterr().err
