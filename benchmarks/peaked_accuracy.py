"""Quantization accuracy on a model with peaked logits: the `small` preset trained for a few
minutes on generated text, then int8/int4 beside llama.cpp's q8_0/q4_0 on the same weights.

Random weights give near-flat next-token distributions, where one rounding flips the top token
(llama.cpp's own q8_0 agrees with its f32 on about 94% of positions there). A trained model's
distributions are peaked, as a real checkpoint's are. So the `small` preset (seed 0) is trained
with AdamW on text from a fixed random Markov chain (each of --vocab tokens has --successors
likely next tokens, Zipf-weighted), until its next-token distributions are sharp; it is saved
as a moedeploy checkpoint and exported as fp32, int8 and int4 (the export's defaults: blocks of
32, symmetric, int4 mixed) into the bench cache; llama.cpp quantizes the f32 GGUF of the same
weights itself. Accuracy against fp32 eager PyTorch, on a fresh --stream-token sample of the
same chain, one teacher-forced pass (the metrics of `moedeploy compare`'s quantization
section): KL mean and max, top-1 agreement, max logit error; moedeploy at accuracy level 4
(int8 activations, what bench times) and 0 (float compute).

    python benchmarks/peaked_accuracy.py [--steps 150] [--stream 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def markov_chain(vocab: int, successors: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `successors` next tokens and their probabilities (Zipf 1/rank, normalised)."""
    g = torch.Generator().manual_seed(seed)
    nexts = torch.stack([torch.randperm(vocab, generator=g)[:successors] for _ in range(vocab)])
    weights = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64)
    return nexts, (weights / weights.sum()).float()


def sample_text(nexts: torch.Tensor, probs: torch.Tensor, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    tokens = torch.empty(batch, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, nexts.shape[0], (batch,), generator=g)
    for t in range(1, length):
        pick = torch.multinomial(probs.expand(batch, -1), 1, generator=g).squeeze(1)
        tokens[:, t] = nexts[tokens[:, t - 1], pick]
    return tokens


def train(steps: int, batch: int, length: int, nexts, probs, progress) -> torch.nn.Module:
    from moedeploy.export.reference import build_decoder

    model = build_decoder("small", None, 0, torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        tokens = sample_text(nexts, probs, batch, length + 1, g)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == steps:
            progress(f"step {step}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2000, help="tokens the chain visits (of the preset's 32,000)")
    parser.add_argument("--successors", type=int, default=8)
    parser.add_argument("--stream", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from quantized import (  # benchmarks/quantized.py
        LLAMA_FORMATS,
        llama_logits,
        llama_quantized,
        ort_logits,
        print_notes,
    )

    from moedeploy.bench.api import cache_dir, quantized_variant
    from moedeploy.bench.peers import gguf_file, missing
    from moedeploy.compare.quantization import distribution_metrics
    from moedeploy.export import export
    from moedeploy.export.artifact import Artifact
    from moedeploy.models.blockquant import QuantScheme
    from moedeploy.models.checkpoint import load_decoder, save_decoder

    torch.set_num_threads(args.threads)
    progress = print
    nexts, probs = markov_chain(args.vocab, args.successors, seed=0)
    folder = cache_dir() / "bench" / f"peaked-small-{args.steps}steps-v{args.vocab}s{args.successors}"
    if (folder / "fp32" / "manifest.json").is_file():  # trained and exported before with these settings
        progress(f"reading the trained model from {folder}")
        model = load_decoder(folder / "checkpoint").eval()
        fp32 = Artifact.load(folder / "fp32")
    else:
        model = train(args.steps, args.batch, args.length, nexts, probs, progress)
        save_decoder(model, folder / "checkpoint")
        fp32 = export("decoder", folder / "fp32", checkpoint=folder / "checkpoint", golden=False)
    artifacts = {"fp32": fp32} | {name: quantized_variant(fp32, QuantScheme(bits), str(folder / "checkpoint"), progress)
                                  for name, bits in (("int8", 8), ("int4", 4))}

    stream = sample_text(nexts, probs, 1, args.stream, torch.Generator().manual_seed(7))
    with torch.no_grad():
        reference = model(stream, model.new_cache(1, args.stream), 0)[0].numpy()
    ref_probs = torch.from_numpy(reference).softmax(-1)
    peak = float(ref_probs.max(-1).values.mean())
    chain_top1 = float((torch.from_numpy(reference).argmax(-1)[:-1] == nexts[stream[0, :-1], 0]).double().mean())
    rows = []
    for name, artifact in artifacts.items():
        if name == "fp32":
            continue
        row = {"system": f"moedeploy {name}", **distribution_metrics(reference, ort_logits(artifact, stream, args.threads, 4))}
        exact = distribution_metrics(reference, ort_logits(artifact, stream, args.threads, 0))
        rows.append(row | {f"{k}_level0": v for k, v in exact.items()})
    if missing("llama.cpp") is None:
        f32 = gguf_file(fp32, folder, progress)
        for kind in ("f32", *(kind for kind, *_ in LLAMA_FORMATS.values())):
            try:
                logits, note = llama_logits(f32 if kind == "f32" else llama_quantized(f32, kind), stream, args.threads)
            except RuntimeError as e:  # the other rows stay
                rows.append({"system": f"llama.cpp {kind}", "error": str(e)})
                continue
            rows.append({"system": f"llama.cpp {kind}", **distribution_metrics(reference, logits), **note})
    print(f"\nthe small preset trained {args.steps} steps on a {args.vocab}-token Markov chain: mean top probability "
          f"{peak:.3f}, argmax = the chain's likeliest next token on {chain_top1:.1%} of positions; "
          f"accuracy against fp32 eager on {args.stream} tokens of the chain")
    print(f"{'system':18s} {'KL mean':>9s} {'KL median':>9s} {'KL max':>8s} {'top-1':>6s} {'max err':>8s}"
          "  level 0: KL mean, median, top-1")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:18s} error: {r['error']}")
            continue
        level0 = (f"  {r['kl_mean_level0']:.5f}, {r['kl_median_level0']:.6f}, {r['top1_level0']:.3f}"
                  if "kl_mean_level0" in r else "")
        print(f"{r['system']:18s} {r['kl_mean']:9.5f} {r['kl_median']:9.6f} {r['kl_max']:8.4f} {r['top1']:6.3f} "
              f"{r['max_logit_error']:8.3f}{level0}")
    print_notes(rows)
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "mean_top_probability": peak,
                                         "chain_top1": chain_top1, "rows": rows}, indent=2, default=float))


if __name__ == "__main__":
    main()
