"""Tier a: ``stapo-eval`` refuses bad input with a message naming it, before it loads anything.
(The end-to-end evaluation on a real tiny model is ``tests/integration/test_eval_sets.py``.)"""

import pytest


@pytest.mark.parametrize("argv, message", [
    (["--out", "{out}"], "no evaluation sets"),
    (["--out", "{out}", "--set", "name=x"], "path is empty"),
    (["--out", "{out}", "--set", "name=x,path=p.jsonl,kk=3"], "has no field 'kk' \\(did you mean 'k'"),
    (["--out", "{out}", "--set", "name=x,path=p.jsonl,decodings=T1_p2"], "top_p must be in \\(0, 1\\]"),
    (["--out", "{out}", "--set", "name=x,path={missing}"], "does not exist"),
    (["--out", "{out}", "--bench-dir", "{missing}"], "benchmark folder .* does not exist"),
])
def test_stapo_eval_bad_input(tmp_path, capsys, argv, message):
    import re

    from stapo_megatron.eval.cli import main

    fill = dict(out=str(tmp_path / "out"), missing=str(tmp_path / "missing.jsonl"))
    assert main([str(tmp_path)] + [a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stapo-eval: error: ") and re.search(message, err), err
