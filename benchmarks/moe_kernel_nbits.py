"""The Triton MoE kernels on a GPU with float, int8 and int4 expert weights.

One Mixtral-8x7B MoE layer (hidden 4096, expert hidden 14336, 8 experts, top-2) per call; for
each token count and weight format it reports the fused kernel's and the grouped pipeline's
time, the bytes of expert weights a call must read (each taken expert's gate, up and down,
with scales and zero points; fp16 weights 2 bytes each), the bandwidth that implies, and the
largest difference from the eager MoE on the dequantized weights (the kernels' contract).
The grouped pipeline runs int8/int4 experts both ways, in the same run: codes into tl.dot with
the scales on the sums (the default), and every tile dequantized first (`codes_in_dot=False`).
`--sweep` also times a few tile shapes of the default way at 1 and 16 tokens.
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

    from moedeploy.plugins.kernels.moe import default_config, moe
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
    print(f"{'tokens':>6} {'weights':>7} {'fused us':>9} {'grouped us':>10} {'tiles dq us':>11} {'MB read':>8} "
          f"{'GB/s':>6} {'max |diff|':>10}")
    rows, sweep = [], []
    for n in args.tokens:
        x = torch.randn(n, h, generator=g, device="cuda").to(dtype)
        logits = torch.randn(n, e, generator=g, device="cuda").to(dtype)
        taken = int(torch.topk(logits.float(), k, dim=-1).indices.unique().numel())
        default = default_config(n, k, e)
        tiles = dataclasses.replace(default, codes_in_dot=False)
        for name, (weights, reference) in formats.items():
            expected = moe_reference(x, logits, *reference, k, True).float()
            outs = {"grouped": moe(x, logits, *weights, k, True).float()}
            if name != "fp16":
                outs["tiles"] = moe(x, logits, *weights, k, True, config=tiles).float()
            if not args.no_fused:
                outs["fused"] = moe_fused(x, logits, *weights, k, True).float()
            diff = max((out - expected).abs().max().item() for out in outs.values())
            time_us = lambda fn: triton.testing.do_bench(fn) * 1e3  # noqa: E731
            grouped_us = time_us(lambda: moe(x, logits, *weights, k, True))  # noqa: B023
            tiles_us = time_us(lambda: moe(x, logits, *weights, k, True, config=tiles)) if name != "fp16" else None  # noqa: B023
            fused_us = None if args.no_fused else time_us(lambda: moe_fused(x, logits, *weights, k, True))  # noqa: B023
            read = sum(_stack_bytes(w, taken) for w in weights)
            row = {"tokens": n, "weights": name, "fused_us": fused_us, "grouped_us": grouped_us,
                   "tiles_dequantized_us": tiles_us, "mb_read": read / 1e6, "grouped_gb_s": read / grouped_us / 1e3,
                   "max_abs_diff": diff}
            rows.append(row)
            show = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            print(f"{n:>6} {name:>7} {show(fused_us):>9} {grouped_us:>10.1f} {show(tiles_us):>11} {row['mb_read']:>8.1f} "
                  f"{row['grouped_gb_s']:>6.0f} {diff:>10.2e}", flush=True)
            if args.sweep and name != "fp16" and n in (1, 16):
                for block_n, warps in ((32, 4), (64, 2), (64, 8), (128, 4), (128, 8)):
                    cfg = dataclasses.replace(default, block_n=block_n, num_warps=warps)
                    err = (moe(x, logits, *weights, k, True, config=cfg).float() - expected).abs().max().item()
                    us = time_us(lambda: moe(x, logits, *weights, k, True, config=cfg))  # noqa: B023
                    sweep.append({"tokens": n, "weights": name, "block_n": block_n, "num_warps": warps, "us": us,
                                  "max_abs_diff": err})
                    print(f"       sweep {name} tokens={n} block_n={block_n} warps={warps}: {us:.1f} us, "
                          f"max |diff| {err:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "sweep": sweep}, f, indent=2)


if __name__ == "__main__":
    main()
