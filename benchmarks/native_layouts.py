"""The native MoE kernel's two weight layouts side by side: experts re-laid in 16-row panels
(what a decoder session runs) against views of the stored rows (what a session sharing the
mapped file runs), in one process.

Why panels: a row-at-a-time GEMV loads x beside every weight vector, two loads an FMA; a panel
of 16 rows stored column by column is read as one stream with x[k] broadcast, one load an FMA,
as MLAS reads its prepacked GEMM and as a plain sum reads memory. Two greedy decoders of the
same artifact, alike but for the layout, decode in paired rounds (order reversed every other
round): step time of a generation after the prompt, the prompt's own time, and whether the
greedy tokens agree. Needs the native kernel (ONNX Runtime's C headers; README, Custom ops).

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/native_layouts.py [ARTIFACT_OR_PRESET] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from decode_ablation import decoder_variant
from decode_profile import artifact_for

from moedeploy.bench.report_file import at_least, script_report_check, write_script_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", default="small", help="an fp32 decoder artifact folder, or a preset")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    at_least(parser, args, {"--threads": 1, "--prompt-len": 1, "--rounds": 1, "--new-tokens": 2})
    script_report_check(parser, args.json, "native_layouts")
    from moedeploy.plugins import native

    try:
        native.library_path()
    except native.NativeUnavailable as e:
        raise SystemExit(f"error: the native kernel is not available here: {e}") from None
    measure(args)


def measure(args: argparse.Namespace) -> None:
    import torch

    from moedeploy.bench.machine import cpu_model
    from moedeploy.runtime.moe_tuning import decode_step_ms

    artifact = artifact_for(args.target)
    # a session's own path (the kernel, checked in main), and the same lowering on the stored rows
    decoders = {"panels": decoder_variant(artifact, None, args.threads),
                "rows": decoder_variant(artifact, None, args.threads, relayout=False)}
    if not all(d.lowered.lowering["moe_native"] for d in decoders.values()):
        raise SystemExit("error: this artifact's sessions do not take the native kernel here (MOEDEPLOY_MOE_PATH, or a "
                         "`moedeploy tune` record, chose another path; or its experts have biases)")
    vocab = artifact.manifest["config"]["vocab_size"]
    prompt = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (1, args.prompt_len)))
    step: dict[str, list[float]] = {name: [] for name in decoders}
    prefill: dict[str, list[float]] = {name: [] for name in decoders}
    tokens = {}
    for round_ in range(args.rounds):
        for name in (list(decoders) if round_ % 2 == 0 else list(reversed(decoders))):
            d = decoders[name]
            ms, tokens[name] = decode_step_ms(d, prompt, args.new_tokens)
            step[name].append(ms)
            d.reset(1, args.prompt_len + 1)
            start = time.perf_counter()
            d.greedy_step(prompt, 0)
            prefill[name].append((time.perf_counter() - start) * 1e3)
    print(f"{cpu_model()}, {args.threads} threads, {args.rounds} rounds; greedy tokens "
          f"{'identical' if tokens['panels'] == tokens['rows'] else 'DIFFER'}")
    report = {"threads": args.threads, "rounds": args.rounds, "step_ms": step, "prefill_ms": prefill,
              "tokens_identical": tokens["panels"] == tokens["rows"]}
    for name in decoders:
        paired = [statistics.median(a / b for a, b in zip(times[name], times["rows"], strict=True))
                  for times in (step, prefill)]
        print(f"{name:6s} decode step {statistics.median(step[name]):6.3f} ms (x{paired[0]:.3f} rows', paired), "
              f"prompt {statistics.median(prefill[name]):6.1f} ms (x{paired[1]:.3f})")
    write_script_report(args.json, "native_layouts", report)


if __name__ == "__main__":
    main()
