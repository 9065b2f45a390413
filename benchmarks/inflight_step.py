"""A prompt joining decoding rows: one ragged step against a separate prefill and decode step.

In-flight batching prefills a joining prompt in the same step that decodes a token for every
running row (runtime/inflight.RowCacheDecoder.step, a ragged step). The alternative, what the
scheduler did before, runs the prompt's prefill on its own and then the rows' decode step: two
passes over the weights, and the running rows wait for the prefill. This benchmark times both
on the same row cache, alternating them within each round, for `--rows` decoding rows beside
one prompt of `--prompt-len` tokens, and checks that both give the same logits.

Then the in-flight scheduler alone (no server) with `--clients` threads, each sending
`--requests` requests of 64-token prompts and 32 new tokens, under each policy alternating
over `--rounds` rounds: prompts in a step of their own (InflightScheduler(prompts_in_step=
False)), whole prompts in the decode step (prefill_chunk=0), and prompts fed in chunks of each
`--chunks` size while rows decode (chunked prefill); reported: tokens/s, decode tokens/s (the
streams' rate after their first token, times the clients, as serving_stream.py), TTFT and
TPOT p50. In two traffic shapes: "lockstep" (every request the same shape, all clients starting together, so
a level's prompts arrive together while no stream decodes) and "varied" (each request's prompt
length and budget drawn from half to one and a half times those, as benchmarks/serving_stream.py
--vary does, so prompts join while others decode).

    python benchmarks/inflight_step.py [--artifact DIR] [--rows 1,4,15] [--prompt-len 64] [--clients 16] [--chunks 16,32] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_stream import (  # --vary's draws, the decode rate
    decode_rates,
    percentile,
    request_shape,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, default=None, help="a decoder artifact (default: the 'small' preset, "
                        "exported once into moedeploy's cache as `moedeploy bench small` does)")
    parser.add_argument("--rows", default="1,4,15", help="comma-separated counts of rows decoding beside the prompt")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--past", type=int, default=64, help="positions each decoding row holds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=5, help="timed steps of each kind per round")
    parser.add_argument("--clients", type=int, default=16, help="scheduler threads (0: skip the scheduler part)")
    parser.add_argument("--requests", type=int, default=4, help="per client, in the scheduler part")
    parser.add_argument("--chunks", default="16,32", help="comma-separated prefill_chunk sizes to compare with whole "
                        "prompts and prompts in their own step, in the scheduler part")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()

    from moedeploy.bench.api import prepare
    from moedeploy.export.artifact import Artifact
    from moedeploy.runtime.inflight import RowCacheDecoder
    from moedeploy.runtime.quantized import RUN_ACCURACY

    if args.artifact is not None:
        artifact = Artifact.load(args.artifact)
    else:
        artifact, _ = prepare("small", ["ort"], 1, args.prompt_len, 32, print)
    levels = [int(r) for r in args.rows.split(",")]
    slots = max(levels) + 1
    decoder = RowCacheDecoder(artifact, slots=slots, capacity=args.past + args.prompt_len, nbits_accuracy=RUN_ACCURACY)
    rng = np.random.default_rng(0)
    vocab = decoder.vocab_size
    for row in range(slots):  # every row holds `past` positions; the steps below write past them
        decoder.prefill(row, rng.integers(0, vocab, (1, args.past)))
    prompt = rng.integers(0, vocab, args.prompt_len)
    results = []
    for rows in levels:
        tokens = rng.integers(0, vocab, rows)
        lengths = np.full(rows, args.past)
        chunks = [np.array([t]) for t in tokens] + [prompt]
        # the same inputs both ways (the rows' new position is rewritten each time): same logits
        together = decoder.step(0, chunks, np.append(lengths, 0))
        apart = np.concatenate([decoder.decode(0, tokens, lengths), decoder.prefill(rows, prompt[None])])
        agreement = float(np.abs(together - apart).max())
        times: dict[str, list[float]] = {"ragged": [], "apart": []}
        for _ in range(args.rounds):
            for kind in ("ragged", "apart"):
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    if kind == "ragged":
                        decoder.step(0, chunks, np.append(lengths, 0))
                    else:
                        decoder.prefill(rows, prompt[None])
                        decoder.decode(0, tokens, lengths)
                    times[kind].append(time.perf_counter() - start)
        ragged, apart_ms = (1e3 * float(np.median(times[k])) for k in ("ragged", "apart"))
        results.append({"rows": rows, "prompt_len": args.prompt_len, "ragged_ms": ragged, "apart_ms": apart_ms,
                        "ratio": ragged / apart_ms, "max_logit_difference": agreement})
        print(f"{rows:>3} rows + a {args.prompt_len}-token prompt: one ragged step {ragged:6.1f} ms, prefill then decode "
              f"{apart_ms:6.1f} ms ({ragged / apart_ms:.2f}x); logits agree to {agreement:.1e}", flush=True)
    scheduler = scheduler_policies(artifact, args) if args.clients else []
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                               "artifact": str(artifact.path), "settings": vars(args),
                                               "results": results, "scheduler": scheduler}, indent=2, default=str))


def policies(chunks: str) -> dict[str, dict]:
    """The scheduler settings compared: prompts in their own step, whole prompts in the decode
    step, and each --chunks size of chunked prefill."""
    out = {"own step": {"prompts_in_step": False}, "whole prompts": {"prefill_chunk": 0}}
    for size in (int(c) for c in chunks.split(",") if c.strip()):
        out[f"chunks of {size}"] = {"prefill_chunk": size}
    return out


def scheduler_policies(artifact, args) -> list[dict]:
    """Tokens/s, decode tokens/s and TTFT of the scheduler alone under each policy,
    alternating within each round, in both traffic shapes."""
    from moedeploy.models.generation import SamplingConfig
    from moedeploy.runtime.inflight import RowCacheDecoder
    from moedeploy.runtime.quantized import RUN_ACCURACY
    from moedeploy.serving.inflight import InflightScheduler

    prompt_len, new_tokens = 64, 32
    decoder = RowCacheDecoder(artifact, slots=args.clients, capacity=2 * (prompt_len + new_tokens),
                              nbits_accuracy=RUN_ACCURACY)
    vocab = decoder.vocab_size
    settings = policies(args.chunks)
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for vary in (False, True):
            for label, kwargs in settings.items():
                scheduler = InflightScheduler(decoder, **kwargs)
                counts = [0] * args.clients
                decoding: list[tuple[int, float]] = []
                ttft: list[float] = []

                def client(i: int, counts: list[int] = counts, scheduler: InflightScheduler = scheduler,
                           vary: bool = vary, decoding: list = decoding, ttft: list = ttft) -> None:
                    rng = np.random.default_rng(i)
                    for _ in range(args.requests):
                        length, budget = request_shape(rng, prompt_len, new_tokens, vary)
                        sent = time.perf_counter()
                        arrivals = [time.perf_counter() for _ in scheduler.stream(rng.integers(0, vocab, length), budget,
                                                                                  SamplingConfig())]
                        counts[i] += len(arrivals)
                        ttft.append(arrivals[0] - sent)
                        if len(arrivals) > 1:
                            decoding.append((len(arrivals) - 1, arrivals[-1] - arrivals[0]))

                threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
                start = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                runs.setdefault(("varied" if vary else "lockstep", label), []).append(
                    {"tokens_per_s": sum(counts) / (time.perf_counter() - start), "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
                     **decode_rates(decoding, args.clients)})
                scheduler.stop()
    out = []
    for shape in ("lockstep", "varied"):
        for label in settings:
            got = runs[(shape, label)]
            medians = {k: float(np.median([r[k] for r in got])) for k in ("tokens_per_s", "decode_tokens_per_s",
                                                                           "ttft_p50_ms", "tpot_p50_ms")}
            out.append({"traffic": shape, "policy": label, **medians, "runs": got})
            print(f"scheduler alone, {args.clients} clients, {shape:8s} traffic, {label:14s}: {medians['tokens_per_s']:6.1f} "
                  f"tokens/s, decode {medians['decode_tokens_per_s']:6.1f}, TTFT p50 {medians['ttft_p50_ms']:6.1f} ms, "
                  f"TPOT p50 {medians['tpot_p50_ms']:5.1f} ms (medians of {args.rounds})", flush=True)
    return out


if __name__ == "__main__":
    main()
