"""`moedeploy bench`: every backend on the same decode workload, beside the machine's roofline."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moedeploy.bench.decode import Settings, run_in_subprocess
from moedeploy.bench.machine import describe
from moedeploy.bench.roofline import decode_step_bytes, decode_step_flops
from moedeploy.export import Artifact, export
from moedeploy.models import PRESETS, DecoderConfig
from moedeploy.utils.io import atomic_write_json

BACKENDS = ("torch", "torch-compile", "hf", "ort", "trt")
Progress = Callable[[str], None]


def cache_dir() -> Path:
    return Path(os.environ.get("MOEDEPLOY_CACHE", Path.home() / ".cache" / "moedeploy"))


def resolve_target(target: str, progress: Progress) -> Artifact:
    """An artifact folder, or a preset name (exported once into the cache, then reused)."""
    if Path(target).is_dir():
        artifact = Artifact.load(target)
        if artifact.kind != "decoder":
            raise ValueError(f"{target} holds a {artifact.kind!r}; bench measures decoder artifacts")
        return artifact
    if target not in PRESETS:
        raise ValueError(f"{target!r} is neither an artifact folder nor a preset ({', '.join(PRESETS)})")
    folder = cache_dir() / "bench" / f"decoder-{target}-fp32-seed0"
    if (folder / "manifest.json").is_file():
        try:
            return Artifact.load(folder)
        except ValueError:
            pass  # stale or damaged: export again
    progress(f"exporting the {target!r} decoder once into {folder}")
    return export("decoder", folder, preset_name=target)


def bench(
    target: str,
    backends: list[str],
    batch: int = 1,
    prompt_len: int = 128,
    new_tokens: int = 64,
    threads: int = 2,
    repeat: int = 3,
    json_path: str | Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    progress = progress or (lambda _: None)
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    if min(batch, prompt_len, new_tokens, threads, repeat) < 1:
        raise ValueError("--batch, --prompt-len, --new-tokens, --threads and --repeat must be >= 1")
    artifact = resolve_target(target, progress)
    config = DecoderConfig.from_dict({k: v for k, v in artifact.manifest["config"].items() if k != "source"})
    if prompt_len + new_tokens > config.max_positions:
        raise ValueError(f"--prompt-len + --new-tokens exceeds the model's {config.max_positions} positions")
    progress("measuring the machine (memory bandwidth, GEMM rate)")
    machine = describe(threads)

    raw = []
    for backend in backends:
        progress(f"{backend}: batch {batch}, prompt {prompt_len}, {new_tokens} new tokens, x{repeat}")
        raw.append(run_in_subprocess(Settings(str(artifact.path), backend, batch, prompt_len, new_tokens, threads, repeat)))

    context = prompt_len + new_tokens // 2  # the average decode step's history
    step_bytes = decode_step_bytes(config, batch, context)
    step_flops = decode_step_flops(config, batch, context)
    floor_s = max(step_bytes / (machine["bandwidth_gbs"] * 1e9), step_flops / (machine["gemm_gflops"] * 1e9))
    bound_tps = batch / floor_s
    prefill_flops = decode_step_flops(config, batch * prompt_len, prompt_len // 2)
    prefill_floor_ms = prefill_flops / (machine["gemm_gflops"] * 1e9) * 1e3

    results = []
    for r in raw:
        if "error" in r:
            results.append({"backend": r["backend"], "metric": "error", "value": r["error"], "unit": ""})
            continue
        for metric, unit in (("prefill_ms", "ms"), ("decode_tokens_per_s", "tokens/s"), ("token_latency_p50_ms", "ms"),
                             ("token_latency_p99_ms", "ms"), ("peak_rss_mb", "MB"), ("load_peak_rss_mb", "MB")):
            results.append({"backend": r["backend"], "metric": metric, "value": round(r[metric], 3), "unit": unit})
        results.append({"backend": r["backend"], "metric": "fraction_of_bandwidth_bound",
                        "value": round(r["decode_tokens_per_s"] / bound_tps, 3), "unit": ""})
        results.append({"backend": r["backend"], "metric": "fraction_of_prefill_gemm_bound",
                        "value": round(prefill_floor_ms / r["prefill_ms"], 3), "unit": ""})

    ok = [r for r in raw if "error" not in r]
    # hf runs transformers' Mixtral with its own random weights: only the others share weights
    agree = len({str(r["tokens"]) for r in ok if r["backend"] != "hf"}) <= 1
    report = {
        "machine": machine,
        "settings": {"target": target, "artifact": str(artifact.path), "batch": batch, "prompt_len": prompt_len,
                     "new_tokens": new_tokens, "threads": threads, "repeat": repeat},
        "roofline": {"decode_step_bytes": step_bytes, "decode_step_flops": step_flops,
                     "decode_bound_tokens_per_s": round(bound_tps, 1), "prefill_gemm_floor_ms": round(prefill_floor_ms, 2)},
        "results": results,
        "ratios": _ratios(ok),
        "greedy_tokens_agree": agree,
        "raw": [{k: v for k, v in r.items() if k != "tokens"} for r in raw],
    }
    if json_path:
        atomic_write_json(json_path, report)
    return report


def _ratios(ok: list[dict]) -> dict[str, dict[str, float]]:
    """Each backend against each eager baseline present (torch, hf)."""
    by = {r["backend"]: r for r in ok}
    ratios = {}
    for name, r in by.items():
        for base in ("torch", "hf"):
            if base in by and base != name:
                b = by[base]
                ratios[f"{name}_vs_{base}"] = {
                    "decode_speedup": round(r["decode_tokens_per_s"] / b["decode_tokens_per_s"], 3),
                    "prefill_time_ratio": round(r["prefill_ms"] / b["prefill_ms"], 3),
                    "peak_rss_ratio": round(r["peak_rss_mb"] / b["peak_rss_mb"], 3),
                }
    return ratios
