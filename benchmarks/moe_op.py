"""The MoE op, every implementation, beside the machine's roofline.

Eight distinct MoE layers at the `small` preset's sizes (hidden 512, expert hidden 1024,
8 experts, top-2) run back to back, as in a decoder, so their 100 MB of expert weights
stream from DRAM and not from a 32 MB L3 (one layer alone would sit in cache and flatter
every number). For each token count:
  seed loop      the seed notebook's per-expert Python loop with boolean masks (fixed to use
                 distinct experts)
  eager          moedeploy's grouped eager reference
  ort-contrib    ONNX Runtime com.microsoft::MoE (the lowering on CPU fp32); with a routing it
                 cannot compute (--routing deepseek-v3: sigmoid scores, a selection bias, groups,
                 scaling) the routing runs on graph ops before it ("routed")
  ort-function   ONNX Runtime running moe::MoE's dense function body
  triton         the grouped Triton kernels (only with a CUDA GPU)
Each figure comes with bytes of expert weights touched / measured bandwidth and
flops / measured GEMM rate, and the fraction of that floor achieved.

    python benchmarks/moe_op.py [--threads 2] [--repeat 20] [--tokens 1 128] [--json out.json]
                                [--routing softmax|deepseek-v3]
"""

from __future__ import annotations

import argparse
import json

import onnx
import torch
import torch.nn.functional as F

from moedeploy.bench.machine import describe, median_seconds
from moedeploy.export.onnx_export import to_onnx
from moedeploy.models import SparseMoE, preset
from moedeploy.plugins.moe import Routing, route
from moedeploy.runtime.lowering import lower_for_ort
from moedeploy.runtime.ort import session_options

LAYERS = 8


#: --routing: the Routing and whether it has a selection bias
ROUTINGS = {
    "softmax": (lambda k: Routing(k, True), False),
    # DeepSeek-V3's: sigmoid scores, e_score_correction_bias, 4 groups of which 2 compete, scaling
    "deepseek-v3": (lambda k: Routing(k, True, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5), True),
}


class MoEStack(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, routing: str = "softmax") -> None:
        super().__init__()
        make, bias = ROUTINGS[routing]
        self.layers = torch.nn.ModuleList(SparseMoE(hidden, inter, experts, make(top_k), score_bias=bias)
                                          for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def seed_loop(stack: MoEStack, x: torch.Tensor) -> torch.Tensor:
    """The seed notebook's SMoE forward (per-expert boolean masks), with distinct experts."""
    for layer in stack.layers:
        w, idx = route(layer.router(x), layer.routing, score_bias=layer.score_bias)
        xr = x.repeat_interleave(layer.top_k, dim=0)
        out = torch.empty_like(xr)
        flat = idx.reshape(-1)
        for e in range(layer.n_experts):
            rows = flat == e
            h = F.silu(xr[rows] @ layer.w_gate[e].T) * (xr[rows] @ layer.w_up[e].T)
            out[rows] = h @ layer.w_down[e].T
        x = x + (out.view(*w.shape, -1) * w.unsqueeze(-1)).sum(1)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--json", default=None)
    parser.add_argument("--routing", choices=list(ROUTINGS), default="softmax")
    args = parser.parse_args()

    import onnxruntime as ort

    torch.set_num_threads(args.threads)
    machine = describe(args.threads)
    c = preset("small")
    torch.manual_seed(0)
    stack = MoEStack(c.hidden_size, c.expert_hidden, c.n_experts, c.top_k, args.routing).eval()
    for p in stack.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model = to_onnx(stack, (torch.randn(3, c.hidden_size),), ["x"], ["y"], ({0: "n"},))
    sessions = {}
    for lowering in ("contrib", "function"):
        lowered, _ = lower_for_ort(onnx.ModelProto.FromString(model.SerializeToString()), moe_lowering=lowering)
        sessions[f"ort-{lowering}"] = ort.InferenceSession(lowered.SerializeToString(), session_options(args.threads))

    expert_bytes = 3 * c.hidden_size * c.expert_hidden * 4
    rows = []
    for n in args.tokens:
        x = torch.randn(n, c.hidden_size)
        experts_touched = min(c.n_experts, c.top_k * n)
        bytes_moved = LAYERS * experts_touched * expert_bytes
        flops = LAYERS * n * c.top_k * 2 * 3 * c.hidden_size * c.expert_hidden
        floor = max(bytes_moved / (machine["bandwidth_gbs"] * 1e9), flops / (machine["gemm_gflops"] * 1e9))
        impls = {
            "seed loop": lambda x=x: seed_loop(stack, x),
            "eager": lambda x=x: stack(x),
            **{name: (lambda s=s, x=x: s.run(None, {"x": x.numpy()})) for name, s in sessions.items()},
        }
        if torch.cuda.is_available():
            from moedeploy.plugins.kernels import moe as triton_moe

            gpu = stack.cuda()
            xg = x.cuda()

            def triton_stack(xg=xg, gpu=gpu):
                y = xg
                for layer in gpu.layers:
                    y = y + triton_moe(y, layer.router(y), layer.w_gate, layer.w_up, layer.w_down, layer.top_k)
                torch.cuda.synchronize()

            impls["triton (GPU)"] = triton_stack
        with torch.inference_mode():
            for name, fn in impls.items():
                seconds = median_seconds(fn, args.repeat)
                rows.append({"tokens": n, "impl": name, "ms": seconds * 1e3, "floor_ms": floor * 1e3,
                             "fraction_of_floor": floor / seconds, "bytes": bytes_moved, "flops": flops})
    print(f"{machine['cpu']}, {args.threads} threads, {machine['bandwidth_gbs']} GB/s, {machine['gemm_gflops']} GFLOP/s; "
          f"{LAYERS} MoE layers of hidden {c.hidden_size}, expert hidden {c.expert_hidden}, {c.n_experts} experts, top-{c.top_k}, "
          f"{args.routing} routing")
    print(f"{'tokens':>6} {'implementation':>14} {'ms':>9} {'floor ms':>9} {'of floor':>9}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['impl']:>14} {r['ms']:>9.2f} {r['floor_ms']:>9.2f} {r['fraction_of_floor']:>8.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "routing": args.routing, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
