"""How much faster is com.microsoft::MoE than moe::MoE's dense function body on ONNX Runtime CPU?

Exports one SparseMoE layer at the `small` preset's sizes (hidden 512, expert hidden 1024,
8 experts, top-2), builds one ONNX Runtime session per lowering, and times both on the same
inputs for a decode-sized (1 token) and a prefill-sized (128 tokens) batch. Ratios are
measured in one run on one machine, never asserted in tests.

    python benchmarks/moe_lowering.py [--threads 2] [--repeat 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import onnx
import torch

from moedeploy.export.onnx_export import to_onnx
from moedeploy.models import SparseMoE, preset
from moedeploy.plugins.moe import moe_reference
from moedeploy.runtime.lowering import lower_for_ort
from moedeploy.runtime.ort import session_options


def time_call(fn, repeat: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()

    import onnxruntime as ort

    c = preset("small")
    torch.manual_seed(0)
    layer = SparseMoE(c.hidden_size, c.expert_hidden, c.n_experts, c.top_k).eval()
    model = to_onnx(layer, (torch.randn(2, 7, c.hidden_size),), ["x"], ["y"], ({0: "batch", 1: "seq"},))
    sessions = {}
    for lowering in ("contrib", "function"):
        lowered, _ = lower_for_ort(onnx.ModelProto.FromString(model.SerializeToString()), moe_lowering=lowering)
        sessions[lowering] = ort.InferenceSession(lowered.SerializeToString(), session_options(args.threads))
    torch.set_num_threads(args.threads)

    rows = []
    for n in args.tokens:
        x = torch.randn(1, n, c.hidden_size)
        feed = {"x": x.numpy()}
        with torch.no_grad():
            ref = layer(x).numpy()
            logits = layer.router(x.reshape(n, -1))
        results = {}
        for name, sess in sessions.items():
            out = sess.run(None, feed)[0]
            assert np.abs(out - ref).max() < 1e-4, f"{name} disagrees with eager"
            results[name] = statistics.median(time_call(lambda s=sess, f=feed: s.run(None, f), args.repeat))
        with torch.no_grad():
            tokens = x.reshape(n, -1)
            results["eager"] = statistics.median(time_call(
                lambda t=tokens, lg=logits: moe_reference(t, lg, layer.w_gate, layer.w_up, layer.w_down, c.top_k),
                args.repeat,
            ))
        rows.append({"tokens": n, **{f"{k}_ms": v * 1e3 for k, v in results.items()},
                     "speedup_contrib_vs_function": results["function"] / results["contrib"]})

    print(f"MoE layer: hidden {c.hidden_size}, expert hidden {c.expert_hidden}, {c.n_experts} experts, "
          f"top-{c.top_k}; ORT {ort.__version__}, {args.threads} threads, median of {args.repeat}")
    print(f"{'tokens':>6} {'contrib ms':>11} {'function ms':>12} {'eager ms':>9} {'contrib speedup':>16}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['contrib_ms']:>11.3f} {r['function_ms']:>12.3f} {r['eager_ms']:>9.3f} "
              f"{r['speedup_contrib_vs_function']:>15.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": {"platform": platform.platform(), "threads": args.threads}, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
