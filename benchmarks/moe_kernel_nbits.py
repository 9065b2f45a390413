"""The Triton MoE kernels on a GPU with float, int8 and int4 expert weights.

One Mixtral-8x7B MoE layer (hidden 4096, expert hidden 14336, 8 experts, top-2) per call; for
each token count and weight format it reports the fused kernel's and the grouped pipeline's
time, the bytes of expert weights a call must read (each taken expert's gate, up and down,
with scales and zero points; fp16 weights 2 bytes each), the bandwidth that implies, and the
largest difference from the eager MoE on the dequantized weights (the kernels' contract).
The grouped pipeline runs each format three ways in the same run: its default for the token
count (`default_config`), the experts as matrix-vector products per routed slot
(`TileConfig(gemv=True)`, `moe_gemv`), and, for int8/int4, every tile dequantized before
`tl.dot` (`codes_in_dot=False`). `--sweep` also times a few shapes of the gemv path at 1 token.
Needs a CUDA GPU (Triton compiles the kernels):

    python benchmarks/moe_kernel_nbits.py [--tokens 1 4 16 64] [--hidden 4096 --inter 14336 --experts 8]
                                          [--no-fused] [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from moedeploy.export.quantize import dequantized
from moedeploy.models.blockquant import PackedWeight, QuantScheme
from moedeploy.plugins.moe import moe_reference


def _stack_bytes(w: torch.Tensor | PackedWeight, taken: int) -> int:
    """Bytes of `taken` experts of one stack."""
    experts = w.shape[0]
    if isinstance(w, PackedWeight):
        total = w.codes.numel() + w.scale.numel() * w.scale.element_size() + (0 if w.zero_point is None else w.zero_point.numel())
    else:
        total = w.numel() * w.element_size()
    return total * taken // experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=14336)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--no-fused", action="store_true", help="skip the fused kernel (73 ms and up a call here)")
    parser.add_argument("--sweep", action="store_true", help="also time tile shapes of the quantized grouped path")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernel_nbits: needs a CUDA GPU (Triton compiles the kernels)")
    import triton.testing

    from moedeploy.plugins.kernels.moe import TileConfig, default_config, moe
    from moedeploy.plugins.kernels.moe_fused import moe_fused

    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.float16
    stacks = [(torch.randn(e, i, h, generator=g, device="cuda") / h**0.5).to(dtype),
              (torch.randn(e, i, h, generator=g, device="cuda") / h**0.5).to(dtype),
              (torch.randn(e, h, i, generator=g, device="cuda") / i**0.5).to(dtype)]
    formats: dict[str, tuple[list, list]] = {"fp16": (stacks, stacks)}
    for bits in (8, 4):
        scheme = QuantScheme(bits, args.block_size, True)
        formats[f"int{bits}"] = ([PackedWeight.from_weight(w, scheme) for w in stacks],
                                 [dequantized(w, scheme) for w in stacks])
    print(f"GPU: {torch.cuda.get_device_name()}; H={h} I={i} E={e} top-{k}, fp16 activations, block {args.block_size}")
    gemv = TileConfig(block_n=32, block_k=128, gemv=True)
    print(f"{'tokens':>6} {'weights':>7} {'fused us':>9} {'default us':>10} {'gemv us':>9} {'tiles dq us':>11} "
          f"{'MB read':>8} {'GB/s best':>9} {'max |diff|':>10}")
    rows, sweep = [], []
    for n in args.tokens:
        x = torch.randn(n, h, generator=g, device="cuda").to(dtype)
        logits = torch.randn(n, e, generator=g, device="cuda").to(dtype)
        taken = int(torch.topk(logits.float(), k, dim=-1).indices.unique().numel())
        tiles = dataclasses.replace(default_config(n, k, e), codes_in_dot=False, gemv=False)
        for name, (weights, reference) in formats.items():
            expected = moe_reference(x, logits, *reference, k, True).float()
            runs = {"default": lambda w=weights: moe(x, logits, *w, k, True),  # noqa: B023
                    "gemv": lambda w=weights: moe(x, logits, *w, k, True, config=gemv)}  # noqa: B023
            if name != "fp16":
                runs["tiles"] = lambda w=weights: moe(x, logits, *w, k, True, config=tiles)  # noqa: B023
            if not args.no_fused:
                runs["fused"] = lambda w=weights: moe_fused(x, logits, *w, k, True)  # noqa: B023
            diff = max((run().float() - expected).abs().max().item() for run in runs.values())
            us = {key: triton.testing.do_bench(run) * 1e3 for key, run in runs.items()}
            read = sum(_stack_bytes(w, taken) for w in weights)
            best = min(us[key] for key in ("default", "gemv", "tiles") if key in us)
            row = {"tokens": n, "weights": name, "fused_us": us.get("fused"), "default_us": us["default"],
                   "gemv_us": us["gemv"], "tiles_dequantized_us": us.get("tiles"), "mb_read": read / 1e6,
                   "best_gb_s": read / best / 1e3, "max_abs_diff": diff}
            rows.append(row)
            show = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            print(f"{n:>6} {name:>7} {show(us.get('fused')):>9} {us['default']:>10.1f} {us['gemv']:>9.1f} "
                  f"{show(us.get('tiles')):>11} {row['mb_read']:>8.1f} {row['best_gb_s']:>9.0f} {diff:>10.2e}", flush=True)
            if args.sweep and n == 1:
                for block_n, block_k, warps in ((16, 128, 4), (64, 128, 4), (32, 256, 4), (32, 256, 8), (16, 256, 2),
                                                (64, 256, 8)):
                    cfg = TileConfig(block_n=block_n, block_k=block_k, num_warps=warps, gemv=True)
                    err = (moe(x, logits, *weights, k, True, config=cfg).float() - expected).abs().max().item()
                    t = triton.testing.do_bench(lambda: moe(x, logits, *weights, k, True, config=cfg)) * 1e3  # noqa: B023
                    sweep.append({"tokens": n, "weights": name, "block_n": block_n, "block_k": block_k,
                                  "num_warps": warps, "us": t, "max_abs_diff": err})
                    print(f"       gemv {name} tokens={n} block_n={block_n} block_k={block_k} warps={warps}: "
                          f"{t:.1f} us, max |diff| {err:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "sweep": sweep}, f, indent=2)


if __name__ == "__main__":
    main()
