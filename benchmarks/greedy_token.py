"""A greedy decode step with its token taken in the graph, against the logits taken out to Python.

`OrtDecoder(artifact, logits="greedy")` adds the output next_token (a TopK with k=1 over the
last position's logits) and `greedy_step` reads that one id a row. Before, a greedy step
brought the (B, V) logits out of ONNX Runtime and took torch's argmax of them in Python,
which on the `small` preset costs a few percent of a decode step. Both paths run here on the
same session, alternating generations in one process (a shared machine's drift between
processes is larger than the difference), and must pick identical tokens.

    python benchmarks/greedy_token.py [ARTIFACT_OR_PRESET] [--rounds 12] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from decode_profile import artifact_for

from moedeploy.bench.report_file import at_least, run_script


def generation(decoder, prompt: torch.Tensor, new_tokens: int, in_graph: bool) -> tuple[float, list[int]]:
    """Decode tokens/s of one greedy generation after the prompt, and its tokens."""
    if in_graph:
        def choose(ids: torch.Tensor, start: int) -> torch.Tensor:
            return decoder.greedy_step(ids, start)[:, None]
    else:
        def choose(ids: torch.Tensor, start: int) -> torch.Tensor:
            return decoder.step(ids, start)[:, -1].argmax(-1, keepdim=True)

    decoder.reset(1, prompt.shape[1] + new_tokens + 1)
    token, tokens = choose(prompt, 0), []
    start = time.perf_counter()
    for i in range(new_tokens):
        token = choose(token, prompt.shape[1] + i)
        tokens.append(int(token))
    return new_tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", nargs="?", default="small", help="a decoder artifact folder, or a preset exported once into bench's cache")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    at_least(parser, args, {"--rounds": 1, "--new-tokens": 2, "--prompt-len": 1, "--threads": 1})

    from moedeploy.runtime.generation import OrtDecoder
    from moedeploy.runtime.quantized import RUN_ACCURACY

    artifact = artifact_for(args.target, (args.prompt_len, args.new_tokens, "--prompt-len + --new-tokens"))
    decoder = OrtDecoder(artifact, threads=args.threads, attention_lowering="gqa", logits="greedy",
                         kv_cache="inplace", nbits_accuracy=RUN_ACCURACY)
    vocab = decoder.vocab_size
    prompt = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (1, args.prompt_len)))
    rates: dict[str, list[float]] = {"logits + torch argmax": [], "greedy_step": []}
    tokens: dict[str, list[int]] = {}
    for round_no in range(args.rounds):
        order = list(rates) if round_no % 2 == 0 else list(rates)[::-1]
        for name in order:
            rate, tokens[name] = generation(decoder, prompt, args.new_tokens, in_graph=name == "greedy_step")
            rates[name].append(rate)
    if len(set(map(tuple, tokens.values()))) != 1:
        raise SystemExit("the two paths picked different tokens")
    old, new = rates.values()
    print(f"{artifact.path}: {args.rounds} rounds of {args.new_tokens} tokens after a {args.prompt_len}-token prompt, "
          f"{args.threads} threads; tokens identical")
    for name, values in rates.items():
        print(f"  {name:22s} {statistics.median(values):7.1f} tokens/s ({min(values):.1f}-{max(values):.1f})")
    print(f"  greedy_step / logits, paired by round: x{statistics.median(n / o for n, o in zip(new, old, strict=True)):.3f}")


if __name__ == "__main__":
    run_script(main)
