"""Where one decode step's time goes on ONNX Runtime: kernel time per op type, from ONNX
Runtime's own profiler, beside the bandwidth floor of the two ops that move the weights.

A decode step of a MoE decoder is bandwidth-bound: its floor is the bytes of weights it
reads / the machine's read bandwidth. This script splits that floor between the MoE nodes
(router, and the top-k experts' weights per layer) and the MatMuls (attention projections
and the LM head), and reports how close each comes, so the next optimisation goes where the
time is. Both attention lowerings are profiled (the traced graph and
com.microsoft::GroupQueryAttention). With `--moe contrib` every MoE is one
com.microsoft::MoE node and its floor is shown; the default lowering (one If per expert)
spreads it over If, Gemm and routing ops. The profiler adds a few microseconds per node, so
step times here are above `moedeploy bench`'s; use bench for speed, this for where it goes.

    python benchmarks/decode_profile.py [ARTIFACT_OR_PRESET] [--moe auto|contrib] [--context 128] [--steps 48]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np

from moedeploy.bench.report_file import (
    at_least,
    run_script,
    script_report_check,
    write_script_report,
)


def artifact_for(target: str, positions: tuple[int, int, str] | None = None):
    """A decoder artifact folder, or a preset's export in `moedeploy bench`'s cache (exported there
    once, then reused, as bench does). Raises ValueError naming what `target` is not, or, before
    any export, where `positions` (tokens before, tokens after, the options that set them) exceed
    the model's."""
    from moedeploy.bench.api import check_positions, existing_artifact, export_preset, target_config

    if positions is not None:
        check_positions(target_config(target), *positions)
    return existing_artifact(target, print) or export_preset(target, print)


def floors_ms(config, bandwidth_gbs: float) -> dict[str, float]:
    """Milliseconds to read, once, the weights each kind of node reads in one decode step (fp32)."""
    from moedeploy.bench.roofline import _attention_params

    c = config
    moe_layers = [i for i in range(c.n_layers) if c.is_moe_layer(i)]
    moe = len(moe_layers) * (c.hidden_size * c.n_experts + c.top_k * 3 * c.hidden_size * c.expert_hidden)
    matmul = c.n_layers * _attention_params(c) + c.hidden_size * c.vocab_size
    return {"MoE": moe * 4 / bandwidth_gbs / 1e6, "MatMul": matmul * 4 / bandwidth_gbs / 1e6}


def profile(artifact, attention: str, context: int, steps: int, threads: int, moe: str = "auto") -> dict:
    from moedeploy.models.config import DecoderConfig
    from moedeploy.runtime.ort import create_session, profile_events
    from moedeploy.runtime.quantized import RUN_ACCURACY

    config = DecoderConfig.from_manifest(artifact.manifest["config"])
    # a quantized artifact at the level it is served and benchmarked at (nothing to it in a float graph)
    lowered = create_session(artifact, ["CPUExecutionProvider"], moe, threads=threads, profile=True,
                             attention_lowering=attention, nbits_accuracy=RUN_ACCURACY)
    (kh, kd), (vh, vd) = config.kv_cache_dims
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(0, config.vocab_size, (1, context))}
    for i in range(config.n_layers):
        feed[f"past_key_values.{i}.key"] = np.zeros((1, kh, 0, kd), np.float32)
        feed[f"past_key_values.{i}.value"] = np.zeros((1, vh, 0, vd), np.float32)
    out = lowered.run(feed)
    for _ in range(steps):
        feed = {"input_ids": rng.integers(0, config.vocab_size, (1, 1))}
        for i in range(config.n_layers):
            feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = out[1 + 2 * i], out[2 + 2 * i]
        out = lowered.run(feed)
    events = profile_events(lowered.session)
    runs = [e for e in events if e.get("name") == "model_run"][1:]  # the decode steps
    start = runs[0]["ts"]
    kernel_us: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["ts"] >= start and e["name"].endswith("_kernel_time"):
            kernel_us[e["args"]["op_name"]] += e["dur"]
            count[e["args"]["op_name"]] += 1
    return {
        "step_ms": sum(e["dur"] for e in runs) / len(runs) / 1e3,
        "kernel_ms": sum(kernel_us.values()) / len(runs) / 1e3,
        "nodes": sum(count.values()) / len(runs),
        "ops": {op: {"ms": us / len(runs) / 1e3, "nodes": count[op] / len(runs)} for op, us in kernel_us.most_common()},
        "config": config,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", default="small", help="a decoder artifact folder, or a preset (small) exported once into bench's cache")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the profiled steps")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--moe", choices=("auto", "contrib"), default="auto", help="the MoE lowering")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    at_least(parser, args, {"--context": 1, "--steps": 1, "--threads": 1})
    script_report_check(parser, args.json, "decode_profile")

    from moedeploy.bench.machine import cpu_model, measure_bandwidth_gbs

    artifact = artifact_for(args.target, (args.context, args.steps, "--context + --steps"))
    bandwidth = measure_bandwidth_gbs(args.threads)
    print(f"{cpu_model()}, {args.threads} threads, {bandwidth:.2f} GB/s; decode steps after {args.context} tokens")
    report = {"bandwidth_gbs": bandwidth, "context": args.context, "profiles": {}}
    for attention in ("graph", "gqa"):
        p = profile(artifact, attention, args.context, args.steps, args.threads, args.moe)
        floors = floors_ms(p.pop("config"), bandwidth)
        report["profiles"][attention] = {**p, "floors_ms": floors}
        print(f"\nattention {attention}: step {p['step_ms']:.2f} ms (profiled), kernels {p['kernel_ms']:.2f} ms, "
              f"{p['nodes']:.0f} nodes")
        print(f"  {'op':28s} {'ms':>7s} {'share':>6s} {'nodes':>5s}  floor ms  of floor")
        for op, figures in list(p["ops"].items())[:10]:
            floor = floors.get(op)
            extra = f"  {floor:8.2f}  {floor / figures['ms']:7.0%}" if floor else ""
            print(f"  {op:28s} {figures['ms']:7.3f} {figures['ms'] / p['kernel_ms']:6.1%} {figures['nodes']:5.0f}{extra}")
    write_script_report(args.json, "decode_profile", report)


if __name__ == "__main__":
    run_script(main)
