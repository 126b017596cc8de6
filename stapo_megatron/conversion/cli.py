"""stapo-convert: HF Qwen <-> Megatron torch_dist checkpoints, and a logit-parity check.

    stapo-convert hf-to-mcore --hf-dir HF --out CKPT [--dtype bfloat16] [--tp N --pp M --ep E]
    stapo-convert mcore-to-hf --ckpt CKPT --out HF [--dtype bfloat16] [--hf-config DIR] [--text-only]
    stapo-convert verify --hf-dir HF --ckpt CKPT --tp N --pp M [--ep E] [--tol 1e-5]
    stapo-convert lora-to-peft --ckpt RUN --out ADAPTER [--alpha A] [--hf-config DIR]

A Qwen3.5 vision-language checkpoint (Qwen3_5ForConditionalGeneration, and its MoE) converts its
text tower; its vision tower is kept verbatim in CKPT/hf/vision_tower.safetensors and put back by
mcore-to-hf (or left out with --text-only, which writes the text model alone).

verify starts TP x PP x EP processes on this host and refuses a layout whose estimated memory
exceeds the available memory (--no-memory-check skips that); a rank the kernel kills is named
with its signal.

Exit codes: 0 success, 1 verify found a mismatch beyond tolerance, 2 bad input (the message
names the problem; nothing that looks complete is left at the output path), 130 interrupted
(Ctrl-C; the output path is left as it was).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _positive(kind):
    """argparse type: a number > 0 (argparse reports the flag and exits with code 2 otherwise)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value > 0:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stapo-convert", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("hf-to-mcore", help="HF folder -> Megatron torch_dist checkpoint")
    a.add_argument("--hf-dir", required=True, help="HF folder (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output checkpoint directory")
    a.add_argument("--dtype", choices=DTYPES, help="stored dtype (default: the HF weights' dtype)")
    a.add_argument("--tp", type=_positive(int), default=1,
                   help="TP size the checkpoint is meant for (checked; any TP loads it)")
    a.add_argument("--pp", type=_positive(int), default=1, help="PP size the checkpoint is meant for (checked)")
    a.add_argument("--ep", type=_positive(int), default=1,
                   help="expert-parallel size the checkpoint is meant for (MoE; checked; any EP loads it)")
    a.add_argument("--threads", type=_positive(int), default=2, help="writer threads")
    a.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")

    b = sub.add_parser("mcore-to-hf", help="Megatron torch_dist checkpoint -> HF folder")
    b.add_argument("--ckpt", required=True, help="checkpoint directory (converted, a training run or one of its steps)")
    b.add_argument("--out", required=True, help="output HF folder")
    b.add_argument("--dtype", choices=DTYPES, help="output dtype (default: the stored dtype)")
    b.add_argument("--hf-config", help="HF folder with config.json/tokenizer (default: the checkpoint's hf/, which "
                   "converted and trainer-written checkpoints carry; needed for other training checkpoints)")
    b.add_argument("--max-shard-gb", type=_positive(float), default=5.0, help="largest safetensors shard in GiB")
    b.add_argument("--text-only", action="store_true",
                   help="a vision-language checkpoint's text tower as the text model alone (Qwen3_5ForCausalLM; "
                   "its vision tower is not written)")
    b.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")

    c = sub.add_parser("verify", help="compare Megatron logits from CKPT with transformers logits from HF")
    c.add_argument("--hf-dir", required=True, help="HF folder (the reference)")
    c.add_argument("--ckpt", required=True, help="Megatron checkpoint directory")
    c.add_argument("--tp", type=_positive(int), default=1, help="tensor-parallel size")
    c.add_argument("--pp", type=_positive(int), default=1, help="pipeline-parallel size")
    c.add_argument("--ep", type=_positive(int), default=1, help="expert-parallel size (MoE; carved out of DP)")
    c.add_argument("--num-prompts", type=_positive(int), default=4, help="fixed random prompts")
    c.add_argument("--seq-len", type=_positive(int), default=32, help="tokens per prompt")
    c.add_argument("--tol", type=float, default=None,
                   help="max |logit difference| relative to max(1, max |logit|) (default FP32_LOGIT_TOL = 1e-5; "
                        "HYBRID_LOGIT_TOL = 3e-5 for Qwen3.5's delta-net models)")
    c.add_argument("--min-top1", type=float, default=1.0, help="minimal top-1 agreement")
    c.add_argument("--no-memory-check", action="store_true",
                   help="start the TP x PP x EP processes even when their estimated memory exceeds the available")

    d = sub.add_parser("lora-to-peft", help="a LoRA run's adapters -> Hugging Face PEFT adapter folder")
    d.add_argument("--ckpt", required=True, help="checkpoint of a LoRA run (a run folder or one of its steps)")
    d.add_argument("--out", required=True,
                   help="output adapter folder (adapter_config.json, adapter_model.safetensors)")
    d.add_argument("--alpha", type=_positive(float),
                   help="lora_alpha (default: the run's lora.alpha, from its config.yaml)")
    d.add_argument("--hf-config", help="HF folder with config.json (default: the checkpoint's hf/)")
    d.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    return p


def _run(args: argparse.Namespace) -> int:
    if args.command == "hf-to-mcore":
        from stapo_megatron.conversion.hf_to_mcore import convert_hf_to_mcore

        record = convert_hf_to_mcore(args.hf_dir, args.out, dtype=DTYPES.get(args.dtype),
                                     tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                     expert_model_parallel_size=args.ep,
                                     overwrite=args.overwrite, thread_count=args.threads)
        print(f"wrote {record['architecture']} checkpoint ({record['dtype']}) to {args.out}")
        if "vision_language" in record:
            vl = record["vision_language"]
            print(f"{vl['architecture']}: its text tower converted; its vision tower ({vl['num_vision_tensors']} "
                  f"tensors) kept verbatim in {os.path.join(args.out, vl['vision_tower'])}, put back by mcore-to-hf")
        return 0
    if args.command == "mcore-to-hf":
        from stapo_megatron.conversion.mcore_to_hf import convert_mcore_to_hf

        files = convert_mcore_to_hf(args.ckpt, args.out, dtype=DTYPES.get(args.dtype), hf_config_dir=args.hf_config,
                                    overwrite=args.overwrite, max_shard_bytes=int(args.max_shard_gb * 2**30),
                                    text_only=args.text_only)
        print(f"wrote {len(files)} safetensors file(s) to {args.out}")
        return 0
    if args.command == "lora-to-peft":
        from stapo_megatron.conversion.peft_export import export_peft

        files = export_peft(args.ckpt, args.out, alpha=args.alpha, hf_config_dir=args.hf_config,
                            overwrite=args.overwrite)
        print(f"wrote the PEFT adapter ({', '.join(os.path.basename(f) for f in files)}) to {args.out}")
        return 0
    from stapo_megatron.conversion.hf_to_mcore import load_spec
    from stapo_megatron.conversion.verify import default_tolerance, format_table, verify

    tol = default_tolerance(load_spec(args.hf_dir)[1]) if args.tol is None else args.tol
    rows = verify(args.hf_dir, args.ckpt, [(args.tp, args.pp)],
                  num_prompts=args.num_prompts, seq_len=args.seq_len, expert_model_parallel_size=args.ep,
                  check_memory=not args.no_memory_check)
    print(format_table(rows, tol))
    return 0 if all(r.ok(tol, args.min_top1) for r in rows) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            # megatron-core warns about absent transformer-engine/apex on every CPU import.
            warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
            return _run(args)
    except (ValueError, OSError) as e:  # OSError: missing files, and a read-only or full disk
        print(f"stapo-convert {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        out = getattr(args, "out", None)
        left = f"; {out} is left as it was" if out else ""
        print(f"stapo-convert {args.command}: interrupted{left}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
