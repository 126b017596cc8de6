"""Tier a: the report reads the commit of each run from its provenance."""


def test_runs_commit_reads_the_runs_provenance(tmp_path):
    import json

    from stapo_megatron.runlog.report import runs_commit

    for name, git in [("a", {"commit": "a640050" + "0" * 33, "dirty": False}),
                      ("b", {"commit": "a640050" + "0" * 33, "dirty": False}),
                      ("c", {"commit": "b123456" + "0" * 33, "dirty": True})]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "provenance.json").write_text(json.dumps({"git": git}))
    assert runs_commit([tmp_path / "a", tmp_path / "b"]) == "a640050"
    assert runs_commit([tmp_path / n for n in "abc"]) == "a640050, b123456 (dirty)"
    assert runs_commit([tmp_path / "missing"]) == "unknown"
