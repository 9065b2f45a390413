"""The Triton MoE kernels on a GPU with float, int8 and int4 expert weights.

One Mixtral-8x7B MoE layer (hidden 4096, expert hidden 14336, 8 experts, top-2) per call; for
each token count and weight format it reports the fused kernel's and the grouped pipeline's
time, the bytes of expert weights a call must read (each taken expert's gate, up and down,
with scales and zero points; fp16 weights 2 bytes each), the bandwidth that implies, and the
largest difference from the eager MoE on the dequantized weights (the kernels' contract).
Needs a CUDA GPU (Triton compiles the kernels):

    python benchmarks/moe_kernel_nbits.py [--tokens 1 4 16 64] [--hidden 4096 --inter 14336 --experts 8]
                                          [--json out.json]
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernel_nbits: needs a CUDA GPU (Triton compiles the kernels)")
    import triton.testing

    from moedeploy.plugins.kernels import moe
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
    print(f"{'tokens':>6} {'weights':>7} {'fused us':>9} {'grouped us':>10} {'MB read':>8} "
          f"{'fused GB/s':>10} {'max |diff|':>10}")
    rows = []
    for n in args.tokens:
        x = torch.randn(n, h, generator=g, device="cuda").to(dtype)
        logits = torch.randn(n, e, generator=g, device="cuda").to(dtype)
        taken = int(torch.topk(logits.float(), k, dim=-1).indices.unique().numel())
        for name, (weights, reference) in formats.items():
            expected = moe_reference(x, logits, *reference, k, True).float()
            fused_out = moe_fused(x, logits, *weights, k, True).float()
            grouped_out = moe(x, logits, *weights, k, True).float()
            diff = max((fused_out - expected).abs().max().item(), (grouped_out - expected).abs().max().item())
            fused_ms = triton.testing.do_bench(lambda: moe_fused(x, logits, *weights, k, True))  # noqa: B023
            grouped_ms = triton.testing.do_bench(lambda: moe(x, logits, *weights, k, True))  # noqa: B023
            read = sum(_stack_bytes(w, taken) for w in weights)
            row = {"tokens": n, "weights": name, "fused_us": fused_ms * 1e3, "grouped_us": grouped_ms * 1e3,
                   "mb_read": read / 1e6, "fused_gb_s": read / fused_ms / 1e6, "max_abs_diff": diff}
            rows.append(row)
            print(f"{n:>6} {name:>7} {row['fused_us']:>9.1f} {row['grouped_us']:>10.1f} {row['mb_read']:>8.1f} "
                  f"{row['fused_gb_s']:>10.0f} {diff:>10.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
