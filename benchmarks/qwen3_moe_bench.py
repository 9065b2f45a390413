#!/usr/bin/env python
"""Eager PyTorch against ONNX Runtime on a Qwen3-MoE checkpoint of the `small` preset's size.

Why: `moedeploy bench` takes a Hugging Face checkpoint folder, and the families issue's
acceptance asks that ONNX Runtime decode at least 2x faster than eager PyTorch on a Qwen3-MoE
of the `small` preset's size, in one run.

1. It builds the checkpoint with transformers (nothing downloaded): Qwen3MoeConfig with the
   `small` preset's sizes (vocab 32000, hidden 512, 8 layers, 8 heads of 64, 2 KV heads,
   8 experts, top-2, expert hidden 1024, rope theta 1e6, RMSNorm eps 1e-5), norm_topk_prob on,
   transformers' own random init (seeded), fp32, written by save_pretrained into FOLDER (kept)
   or a temporary folder (removed at the end). A FOLDER this script wrote before with the same
   parameters is reused; any other non-empty FOLDER is refused.
2. It runs, in one process of its own:
       moedeploy bench FOLDER --backend torch,ort --threads 2 --repeat 3 --json FILE
   which exports the checkpoint once into the bench cache (reused on later runs while its
   weights fingerprint and config match) and times each backend in its own process.
3. It prints decode tokens/s of each backend, their ratio, prefill ms and peak RSS.

    python benchmarks/qwen3_moe_bench.py /tmp/qwen3-moe-small --json qwen3_moe_bench.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MARKER = ".qwen3_moe_bench.json"  # written last by this script: the folder's parameters
SHAPE = {
    "vocab_size": 32000, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 1024, "intermediate_size": 1024, "max_position_embeddings": 2048,
    "norm_topk_prob": True, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False,
}


def build_checkpoint(folder: Path, seed: int) -> None:
    """The Qwen3-MoE checkpoint, or nothing when `folder` already holds this script's one."""
    stamp = {"shape": SHAPE, "seed": seed, "dtype": "float32"}
    if (folder / MARKER).is_file() and json.loads((folder / MARKER).read_text()) == stamp:
        print(f"reusing the checkpoint in {folder} (made by this script with the same parameters)", flush=True)
        return
    if folder.exists() and any(folder.iterdir()):
        sys.exit(f"error: {folder} is not empty and was not written by this script with these parameters; "
                 "name an empty or new folder")
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    shape = {k: v for k, v in SHAPE.items() if k != "rope_theta"}
    config = Qwen3MoeConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": SHAPE["rope_theta"]},
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"saving a Qwen3-MoE checkpoint ({n / 1e6:.1f} M parameters, fp32) into {folder}", flush=True)
    model.save_pretrained(folder)
    (folder / MARKER).write_text(json.dumps(stamp))


def summary(report: dict) -> list[str]:
    m = report["machine"]
    by = {(r["backend"], r["metric"]): r["value"] for r in report["results"]}
    lines = [f"machine: {m['cpu']}, {m['threads']} threads: {m['bandwidth_gbs']} GB/s read, "
             f"{m['gemm_gflops']} GFLOP/s fp32 GEMM; decode bound "
             f"{report['roofline']['decode_bound_tokens_per_s']} tokens/s"]
    for backend in ("torch", "ort"):
        if (backend, "decode_tokens_per_s") not in by:
            lines.append(f"{backend}: failed")
            continue
        lines.append(f"{backend}: decode {by[backend, 'decode_tokens_per_s']:.1f} tokens/s, "
                     f"prefill {by[backend, 'prefill_ms']:.1f} ms, peak RSS {by[backend, 'peak_rss_mb']:.0f} MB")
    if ratio := report["ratios"].get("ort_vs_torch"):
        speedup = ratio["decode_speedup"]
        lines.append(f"ort / torch decode: x{speedup:.2f} (target >= 2: {'met' if speedup >= 2 else 'NOT met'}); "
                     f"prefill time x{ratio['prefill_time_ratio']:.2f}, peak memory x{ratio['peak_rss_ratio']:.2f}")
    lines.append(f"greedy tokens agree: {report['greedy_tokens_agree']}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, help="where the checkpoint goes (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=Path("qwen3_moe_bench.json"), help="bench's JSON report")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="qwen3-moe-small-") as tmp:
        folder = args.folder or Path(tmp) / "checkpoint"
        build_checkpoint(folder, args.seed)
        command = [sys.executable, "-m", "moedeploy.cli", "bench", str(folder), "--backend", "torch,ort",
                   "--threads", "2", "--repeat", "3", "--json", str(args.json)]
        args.json.unlink(missing_ok=True)  # no figures from an earlier run if this one fails
        print("$ " + " ".join(command[2:]), flush=True)
        done = subprocess.run(command, check=False)
    if not args.json.is_file():
        return done.returncode or 1
    print()
    for line in summary(json.loads(args.json.read_text())):
        print(line)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
