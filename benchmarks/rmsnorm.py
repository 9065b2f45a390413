"""RMSNorm, every implementation, beside the bandwidth floor (it reads x once and writes y once).

    eager         moedeploy.models.RMSNorm (fp32 statistics, Llama rounding)
    torch         torch.nn.functional.rms_norm
    ort-native    the exported moe::RMSNorm lowered to ONNX RMSNormalization-23
    triton        the plugin's Triton kernel (only with a CUDA GPU)

    python benchmarks/rmsnorm.py [--threads 2] [--repeat 50] [--rows 1 128 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from moedeploy.bench.machine import describe, median_seconds
from moedeploy.export.onnx_export import to_onnx
from moedeploy.models import RMSNorm
from moedeploy.runtime.lowering import lower_for_ort
from moedeploy.runtime.ort import session_options

HIDDEN = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 128, 4096])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import onnxruntime as ort

    torch.set_num_threads(args.threads)
    machine = describe(args.threads)
    norm = RMSNorm(HIDDEN).eval()
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    model = to_onnx(norm, (torch.randn(3, HIDDEN),), ["x"], ["y"], ({0: "n"},))
    lowered, counts = lower_for_ort(model)
    assert counts["rmsnorm_native"] == 1
    session = ort.InferenceSession(lowered.SerializeToString(), session_options(args.threads))

    rows = []
    for n in args.rows:
        x = torch.randn(n, HIDDEN)
        impls = {
            "eager": lambda x=x: norm(x),
            "torch": lambda x=x: torch.nn.functional.rms_norm(x, (HIDDEN,), norm.weight, norm.eps),
            "ort-native": lambda x=x: session.run(None, {"x": x.numpy()}),
        }
        if torch.cuda.is_available():
            from moedeploy.plugins.kernels import rms_norm

            xg, wg = x.cuda(), norm.weight.detach().cuda()

            def triton_norm(xg=xg, wg=wg):
                rms_norm(xg, wg, norm.eps)
                torch.cuda.synchronize()

            impls["triton (GPU)"] = triton_norm
        bytes_moved = 2 * n * HIDDEN * 4 + HIDDEN * 4
        floor = bytes_moved / (machine["bandwidth_gbs"] * 1e9)
        with torch.inference_mode():
            for name, fn in impls.items():
                seconds = median_seconds(fn, args.repeat)
                rows.append({"rows": n, "impl": name, "us": seconds * 1e6, "floor_us": floor * 1e6,
                             "fraction_of_floor": floor / seconds})
    print(f"{machine['cpu']}, {args.threads} threads, {machine['bandwidth_gbs']} GB/s; RMSNorm over {HIDDEN} features")
    print(f"{'rows':>6} {'implementation':>14} {'us':>10} {'floor us':>9} {'of floor':>9}")
    for r in rows:
        print(f"{r['rows']:>6} {r['impl']:>14} {r['us']:>10.1f} {r['floor_us']:>9.1f} {r['fraction_of_floor']:>8.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
