"""Decode speed at a short and a long context, measured in one run: does a step's cost grow with
the sequence only as much as attention itself must?

Each (context, backend) pair runs in a fresh process (`moedeploy bench`'s worker), the pairs
interleaved over the rounds, so a slow spell of a shared machine hits every pair alike. The
ratio long/short per backend is what the decode-speed issue asks of the KV cache (within 25%).

    python benchmarks/context_scaling.py small --backend ort,llama.cpp --contexts 128 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from moedeploy.bench.api import (
    cache_dir,
    check_positions,
    existing_artifact,
    export_preset,
    merge_rounds,
    target_config,
)
from moedeploy.bench.checks import require_backends
from moedeploy.bench.decode import Settings, keeps_extra_buffers, run_in_subprocess
from moedeploy.bench.peers import gguf_file
from moedeploy.bench.report_file import (
    at_least,
    run_script,
    script_report_check,
    write_script_report,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", default="small", help="a decoder artifact folder or a preset")
    parser.add_argument("--backend", default="ort", help="comma-separated bench backends")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024], help="prompt lengths; the first is the base")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="timed generations per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    at_least(parser, args, {"--contexts": 1, "--new-tokens": 2, "--threads": 1, "--repeat": 1, "--rounds": 1})
    script_report_check(parser, args.json, "context_scaling")
    backends = require_backends([b.strip() for b in args.backend.split(",") if b.strip()])
    check_positions(target_config(args.target), max(args.contexts), args.new_tokens,
                    "the longest of --contexts + --new-tokens")  # before any export
    artifact = existing_artifact(args.target, print) or export_preset(args.target, print)
    peer_model = str(gguf_file(artifact, cache_dir() / "bench", print)) if "llama.cpp" in backends else None
    runs: dict[tuple[int, str], list[dict]] = {(c, b): [] for c in args.contexts for b in backends}
    for round_no in range(1, args.rounds + 1):
        for context, backend in runs:
            print(f"round {round_no}/{args.rounds}: {backend} at {context} tokens of context", file=sys.stderr)
            runs[context, backend].append(run_in_subprocess(Settings(
                str(artifact.path), backend, 1, context, args.new_tokens, args.threads, args.repeat,
                peer_model=peer_model if backend == "llama.cpp" else None,
                peer_extra_buffers=keeps_extra_buffers(runs[context, backend]))))
    results = {f"{b}@{c}": merge_rounds(r) for (c, b), r in runs.items()}
    for name, r in results.items():
        if "note" in r:
            print(f"note: {name}: {r['note']}", file=sys.stderr)
    failed = {name: r["error"] for name, r in results.items() if "error" in r}
    if failed:
        print(json.dumps(failed, indent=1), file=sys.stderr)
        return 1
    base = args.contexts[0]
    print(f"{'backend':<12}" + "".join(f"{c:>10}" for c in args.contexts) + "   decode tokens/s (median), ratio to the first")
    summary = {}
    for b in backends:
        rates = [results[f"{b}@{c}"]["decode_tokens_per_s"] for c in args.contexts]
        summary[b] = {str(c): {"decode_tokens_per_s": r, "ratio": r / rates[0],
                               "spread": [min(results[f"{b}@{c}"]["decode_tokens_per_s_all"]),
                                          statistics.median(results[f"{b}@{c}"]["decode_tokens_per_s_all"]),
                                          max(results[f"{b}@{c}"]["decode_tokens_per_s_all"])]}
                      for c, r in zip(args.contexts, rates, strict=True)}
        print(f"{b:<12}" + "".join(f"{r:>10.1f}" for r in rates) + "   "
              + ", ".join(f"{c}: x{r / rates[0]:.2f}" for c, r in zip(args.contexts[1:], rates[1:], strict=True)))
    if args.json:
        write_script_report(args.json, "context_scaling", {"settings": vars(args) | {"json": str(args.json)},
                                                           "base_context": base, "results": summary})
    return 0


if __name__ == "__main__":
    run_script(main)
