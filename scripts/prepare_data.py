"""Turn downloaded DAPO-Math-17k and the paper's six benchmarks into the files the recipes read.

    python scripts/prepare_data.py dapo DOWNLOADED OUT/dapo_math_17k.jsonl
    python scripts/prepare_data.py bench NAME DOWNLOADED OUT_DIR [--prompt-field F] [--answer-field F]

DOWNLOADED is a parquet or JSONL file or an HF dataset folder (``save_to_disk``). ``dapo`` keeps
one copy of each repeated problem (the published parquet repeats each ~100 times) and writes
``{"id", "prompt", "answer"}`` rows (``data.train_path``); ``bench`` writes ``OUT_DIR/NAME.jsonl``
with the same fields, the layout ``stapo-eval --bench-dir OUT_DIR`` and ``eval.sets`` read.
NAME is one of aime24, aime25, amc23, math500, minerva, olympiadbench. Sources: README, "Data".
"""

import argparse
import json
import os
import sys

BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")
"""The paper's benchmarks, as ``stapo-eval --bench-dir`` names their files."""


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
    b.add_argument("src")
    b.add_argument("out_dir")
    for a in (d, b):
        a.add_argument("--prompt-field", default="", help="the question's field (default: detected)")
        a.add_argument("--answer-field", default="", help="the answer's field (default: detected)")
    args = p.parse_args(argv)
    from stapo_megatron.data.examples import load_examples
    from stapo_megatron.eval.scoring import load_benchmark

    try:
        if args.command == "dapo":
            examples = load_examples(args.src, dedupe=True, prompt_field=args.prompt_field,
                                     answer_field=args.answer_field)
            out = args.out
        else:
            examples = load_benchmark(args.src, args.prompt_field, args.answer_field)
            out = os.path.join(args.out_dir, f"{args.name}.jsonl")
    except (ValueError, OSError) as e:
        print(f"prepare_data {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {write_jsonl(examples, out)} problems to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
