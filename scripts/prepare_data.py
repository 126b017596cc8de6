"""Turn downloaded DAPO-Math-17k and the paper's six benchmarks into the files the recipes read.

    python scripts/prepare_data.py dapo DOWNLOADED OUT/dapo_math_17k.jsonl
    python scripts/prepare_data.py bench NAME DOWNLOADED [DOWNLOADED ...] OUT_DIR [--prompt-field F] [--answer-field F]

DOWNLOADED is a parquet or JSONL file or an HF dataset folder (``save_to_disk``). ``dapo`` keeps
one copy of each repeated problem (the published parquet repeats each ~100 times) and writes
``{"id", "prompt", "answer"}`` rows (``data.train_path``); ``bench`` writes ``OUT_DIR/NAME.jsonl``
with the same fields, the layout ``stapo-eval --bench-dir OUT_DIR`` and ``eval.sets`` read.
NAME is one of aime24, aime25, amc23, math500, minerva, olympiadbench. Sources: docs/data.md.
Several DOWNLOADED files are joined in the order given: AIME 2025 is published as two files
(AIME 2025 I and II, 15 problems each), and ``bench aime25`` takes both (it refuses fewer than
30 problems). Answers are written in the form a boxed answer takes (``12.0`` as ``12``, a list
``["$2$", "$-2$"]`` as ``2, -2``). No output may be one of the inputs.
"""

import argparse
import json
import os
import sys

BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
"""The paper's benchmarks, as ``stapo-eval --bench-dir`` names their files."""
EXPECTED_PROBLEMS = {"aime25": 30}
"""Problem counts checked after joining the inputs: the sets published in parts."""


def check_not_input(out: str, sources) -> None:
    """ValueError if ``out`` is one of ``sources`` (writing it would destroy the download)."""
    for src in sources:
        if os.path.exists(out) and os.path.samefile(out, src) or os.path.abspath(out) == os.path.abspath(src):
            raise ValueError(f"the output {out} is the input {src}; write to another path (the input would be lost)")


def load_bench(name: str, sources, prompt_field: str = "", answer_field: str = "") -> list:
    """The problems of every file in ``sources``, in order; ids made unique by the file's stem
    where two files repeat one (AIME I and II both count from 1)."""
    from stapo_megatron.eval.scoring import load_benchmark

    parts = [load_benchmark(src, prompt_field, answer_field) for src in sources]
    examples = [e for part in parts for e in part]
    if len({e.id for e in examples}) < len(examples):
        for src, part in zip(sources, parts):
            stem = os.path.splitext(os.path.basename(src.rstrip(os.sep)))[0]
            for e in part:
                e.id = f"{stem}-{e.id}"
    want = EXPECTED_PROBLEMS.get(name)
    if want is not None and len(examples) != want:
        counts = ", ".join(f"{src}: {len(part)}" for src, part in zip(sources, parts))
        raise ValueError(f"{name} has {want} problems, the input has {len(examples)} ({counts})"
                         + ("; AIME 2025 is published as two files (I and II): pass both" if name == "aime25" else ""))
    return examples


def write_jsonl(examples, out: str) -> int:
    """Write ``{"id", "prompt", "answer"}`` rows to ``out`` atomically; the number written."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps({"id": e.id, "prompt": e.prompt, "answer": e.answer}, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return len(examples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dapo", help="DAPO-Math-17k -> training JSONL")
    d.add_argument("src")
    d.add_argument("out")
    b = sub.add_parser("bench", help="a benchmark -> OUT_DIR/NAME.jsonl")
    b.add_argument("name", choices=BENCHMARKS)
    b.add_argument("src", nargs="+", help="the downloaded file(s), joined in this order")
    b.add_argument("out_dir")
    for a in (d, b):
        a.add_argument("--prompt-field", default="", help="the question's field (default: detected)")
        a.add_argument("--answer-field", default="", help="the answer's field (default: detected)")
    args = p.parse_args(argv)
    from stapo_megatron.data.examples import load_examples

    try:
        if args.command == "dapo":
            out, sources = args.out, [args.src]
            check_not_input(out, sources)
            examples = load_examples(args.src, dedupe=True, prompt_field=args.prompt_field,
                                     answer_field=args.answer_field)
        else:
            out, sources = os.path.join(args.out_dir, f"{args.name}.jsonl"), args.src
            check_not_input(out, sources)
            examples = load_bench(args.name, sources, args.prompt_field, args.answer_field)
    except (ValueError, OSError) as e:
        print(f"prepare_data {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {write_jsonl(examples, out)} problems to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
