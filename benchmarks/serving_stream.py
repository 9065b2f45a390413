"""Streaming generation under load: `moedeploy serve`'s `<name>_stream` with 1, 4, 16 and 32
concurrent gRPC streaming clients.

The server runs in its own process (`moedeploy serve`, as users run it); each client is a
thread with its own tritonclient gRPC stream, sending `--requests` requests one after another
(`--prompt-len` random prompt ids, `--new-tokens` greedy tokens). Per level: aggregate decode
tokens/s (every token received / the level's wall time), time to first token (request sent ->
first response) and inter-token latency (gaps between one request's tokens as they arrive: a
response holding several tokens, which a client that falls behind gets, counts its first after
the gap and the others after 0), p50 and p99,
and the speed of one client for comparison. Decode apart from prefill: each request's time per
output token after its first (TPOT: (last arrival - first arrival) / (tokens - 1), p50 and
p99) and the level's decode tokens/s, its streams' mean decode rate (tokens after the first
over the time they took, summed over requests) times the number of clients: the rate the
clients receive tokens at while they decode, each request's prefill being in its TTFT. Beside them: the model alone on ONNX Runtime, one
sequence at a time (tokens/s of a bare decode loop in this process), and the in-flight
scheduler alone at each level (its clients as threads in this process, no Triton). Measured in
one run on one machine, never asserted in tests.

--vary draws each request's prompt length and token budget uniformly from half to one and a
half times --prompt-len and --new-tokens (seeded per client, the same draws at every level), as
real traffic varies: requests then start and end at different steps, so prompts join beside
streams that are decoding. Without it every request has the same shape, so the clients move in
lockstep and a level's prompts are prefilled together while no stream decodes.

--bad-client adds one more client that sends malformed requests throughout every level (token
ids outside the vocabulary, a prompt + max_tokens over max_positions, no prompt, a negative
temperature): each must get one error naming its own problem, and the good requests none. The
server's memory (the PSS of its whole process tree) is sampled after the warm-up and after each
level: it should stay flat.

    python benchmarks/serving_stream.py [--artifact DIR] [--clients 1,4,16,32] [--vary] [--bad-client] [--stream-interval N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_soak import tree_pss_mb  # the server's memory: its process tree's PSS

from serving import (  # the `moedeploy serve` subprocess of benchmarks/serving.py
    Server,
    make_request,
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def one_stream(client, model: str, prompt: np.ndarray, new_tokens: int, answers: queue.Queue) -> tuple[float, list[float]]:
    """(time to first token, arrival times: one per token) of one streamed request on an open gRPC stream."""
    import tritonclient.grpc as grpcclient

    ids = grpcclient.InferInput("input_ids", [1, prompt.size], "INT64")
    ids.set_data_from_numpy(prompt.reshape(1, -1))
    limit = grpcclient.InferInput("max_tokens", [1, 1], "INT64")
    limit.set_data_from_numpy(np.array([[new_tokens]], dtype=np.int64))
    sent = time.perf_counter()
    client.async_stream_infer(model, [ids, limit], enable_empty_final_response=True)
    arrivals = []
    while True:
        arrived, result, error = answers.get(timeout=600)
        if error is not None:
            raise RuntimeError(str(error))
        if result.get_response().parameters["triton_final_response"].bool_param:
            return arrivals[0] - sent, arrivals
        arrivals += [arrived] * result.as_numpy("output_ids").size  # a response holds the tokens made since the last


def bad_requests(vocab: int, max_positions: int) -> list[tuple[dict[str, np.ndarray], str]]:
    """Malformed stream requests and a piece of the error each must get."""
    return [
        ({"input_ids": np.array([[1, vocab + 5]], dtype=np.int64)}, "outside the vocabulary"),
        ({"input_ids": np.array([[1, 2]], dtype=np.int64), "max_tokens": np.array([[max_positions]], dtype=np.int64)},
         "exceeds max_positions"),
        ({"max_tokens": np.array([[4]], dtype=np.int64)}, "send the prompt as"),
        ({"input_ids": np.array([[1, 2]], dtype=np.int64), "temperature": np.array([[-1.0]], dtype=np.float32)},
         "temperature must be >= 0"),
    ]


def bad_client(server: Server, model: str, vocab: int, max_positions: int, stop: threading.Event, tally: dict) -> None:
    """Sends malformed requests until `stop`, each on a fresh stream; tallies what came back."""
    import tritonclient.grpc as grpcclient

    cases = bad_requests(vocab, max_positions)
    i = 0
    while not stop.is_set():
        inputs, expected = cases[i % len(cases)]
        i += 1
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.url["grpc"])
        client.start_stream(callback=lambda result, error, answers=answers: answers.put((result, error)))
        _, tensors = make_request("grpc", inputs)
        client.async_stream_infer(model, tensors, enable_empty_final_response=True)
        _, error = answers.get(timeout=60)
        ok = error is not None and expected in str(error)
        tally["answered_own_error" if ok else "wrong_answer"] += 1
        if not ok and len(tally["examples"]) < 3:
            tally["examples"].append(str(error)[:200] if error is not None else "a response, not an error")
        client.stop_stream()
        client.close()


def request_shape(rng: np.random.Generator, prompt_len: int, new_tokens: int, vary: bool) -> tuple[int, int]:
    """A request's prompt length and token budget: as given, or (--vary) drawn from half to one and a half times them."""
    if not vary:
        return prompt_len, new_tokens
    return (int(rng.integers(max(1, prompt_len // 2), 3 * prompt_len // 2 + 1)),
            int(rng.integers(max(1, new_tokens // 2), 3 * new_tokens // 2 + 1)))


def level(server: Server, model: str, clients: int, requests: int, prompt_len: int, new_tokens: int,
          vocab: int, max_positions: int | None = None, vary: bool = False) -> dict:
    """One concurrency level; max_positions given: a bad client sends malformed requests meanwhile."""
    import tritonclient.grpc as grpcclient

    ttft, itl, tokens, errors = [], [], [0], []
    decoding: list[tuple[int, float]] = []  # per request: tokens after its first, the time they took
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)
    bad = {"answered_own_error": 0, "wrong_answer": 0, "examples": []}
    stop_bad = threading.Event()
    bad_thread = None
    if max_positions is not None:
        bad_thread = threading.Thread(target=bad_client, args=(server, model, vocab, max_positions, stop_bad, bad))
        bad_thread.start()

    def client_loop(seed: int) -> None:
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.url["grpc"])
        client.start_stream(callback=lambda result, error: answers.put((time.perf_counter(), result, error)))
        rng = np.random.default_rng(seed)
        barrier.wait()
        for _ in range(requests):
            length, budget = request_shape(rng, prompt_len, new_tokens, vary)
            prompt = rng.integers(0, vocab, length, dtype=np.int64)
            try:
                first, arrivals = one_stream(client, model, prompt, budget, answers)
            except Exception as e:  # counted and reported, the run goes on
                with lock:
                    errors.append(str(e)[:200])
                continue
            with lock:
                ttft.append(first)
                itl.extend(np.diff(arrivals).tolist())
                tokens[0] += len(arrivals)
                if len(arrivals) > 1:
                    decoding.append((len(arrivals) - 1, arrivals[-1] - arrivals[0]))
        client.stop_stream()
        client.close()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    stop_bad.set()
    if bad_thread is not None:
        bad_thread.join()
    return {
        "clients": clients, "requests": clients * requests, "errors": len(errors), "first_errors": errors[:3],
        "bad_requests": bad if bad_thread is not None else None, "server_pss_mb": tree_pss_mb(server.proc.pid),
        "tokens": tokens[0], "wall_s": wall, "tokens_per_s": tokens[0] / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99),
        **decode_rates(decoding, clients),
    }


def decode_rates(decoding: list[tuple[int, float]], clients: int) -> dict:
    """TPOT p50/p99 over requests and the level's decode tokens/s (clients x the streams' mean
    decode rate) from each request's (tokens after its first, seconds from its first to its last)."""
    tpot = [span / n for n, span in decoding]
    span = sum(span for _, span in decoding)
    return {"tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99),
            "decode_tokens_per_s": clients * sum(n for n, _ in decoding) / span if span > 0 else float("nan")}


def bare_decode(artifact, prompt_len: int, new_tokens: int) -> float:
    """Tokens/s of the model alone: OrtDecoder's greedy loop, one sequence, in this process."""
    import torch

    from moedeploy.runtime.generation import OrtDecoder
    from moedeploy.runtime.quantized import RUN_ACCURACY

    # a quantized artifact at the level serve runs it at
    decoder = OrtDecoder(artifact, threads=2, logits="last", nbits_accuracy=RUN_ACCURACY)
    prompt = torch.randint(0, decoder.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    decoder.generate(prompt, max_new_tokens=4)  # warm-up
    start = time.perf_counter()
    decoder.generate(prompt, max_new_tokens=new_tokens)
    return new_tokens / (time.perf_counter() - start)


def scheduler_alone(artifact, levels: list[int], requests: int, prompt_len: int, new_tokens: int,
                    vary: bool = False, prefill_chunk: int | None = None) -> dict[int, dict]:
    """Tokens/s (and decode tokens/s, as a served level's) of the in-flight scheduler in this
    process, without Triton: clients as threads reading `InflightScheduler.stream` (the same
    level shape as the served run). What the served run loses beside it is the cost of sending
    every token through PyTriton, Triton and gRPC."""
    from moedeploy.models.generation import SamplingConfig
    from moedeploy.runtime.inflight import RowCacheDecoder
    from moedeploy.runtime.quantized import RUN_ACCURACY
    from moedeploy.serving.inflight import InflightScheduler

    # a quantized artifact at the level serve runs it at
    capacity = 2 * (prompt_len + new_tokens) if vary else prompt_len + new_tokens
    decoder = RowCacheDecoder(artifact, slots=max(levels), capacity=capacity, nbits_accuracy=RUN_ACCURACY)
    scheduler = InflightScheduler(decoder, **({} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}))
    vocab = artifact.manifest["config"]["vocab_size"]
    results = {}
    try:
        list(scheduler.stream(np.arange(8), 4, SamplingConfig()))  # warm-up
        for clients in levels:
            counts = [0] * clients
            decoding: list[tuple[int, float]] = []

            def client(i: int, counts: list[int] = counts, decoding: list = decoding) -> None:
                rng = np.random.default_rng(i)
                for _ in range(requests):
                    length, budget = request_shape(rng, prompt_len, new_tokens, vary)
                    arrivals = [time.perf_counter() for _ in scheduler.stream(rng.integers(0, vocab, length), budget,
                                                                              SamplingConfig())]
                    counts[i] += len(arrivals)
                    if len(arrivals) > 1:
                        decoding.append((len(arrivals) - 1, arrivals[-1] - arrivals[0]))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            results[clients] = {"tokens_per_s": sum(counts) / (time.perf_counter() - start),
                                **decode_rates(decoding, clients)}
    finally:
        scheduler.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, default=None, help="a decoder artifact (default: the 'small' preset, "
                        "exported once into moedeploy's cache as `moedeploy bench small` does)")
    parser.add_argument("--clients", default="1,4,16,32", help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=int, default=2, help="per client and level")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--backend", default="ort")
    parser.add_argument("--vary", action="store_true", help="each request's prompt length and budget drawn from "
                        "0.5-1.5x --prompt-len and --new-tokens (requests start and end at different steps)")
    parser.add_argument("--bad-client", action="store_true", help="one more client sending malformed requests throughout")
    parser.add_argument("--stream-interval", type=int, default=1, help="serve --stream-interval: tokens per response after the first")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="serve --prefill-chunk (and the scheduler "
                        "alone's): prompt tokens a step takes while streams decode; 0: whole prompts")
    parser.add_argument("--packed-weights", choices=("stream", "all"), default=None, help="serve --packed-weights")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    for name, value in (("max_queue_delay_us", 100), ("instances", 1), ("max_batch_size", None)):
        setattr(args, name, value)  # what benchmarks/serving.Server reads

    from moedeploy.bench.api import prepare
    from moedeploy.export.artifact import Artifact

    if args.artifact is not None:
        artifact = Artifact.load(args.artifact)
    else:  # the cached export `moedeploy bench small` uses (made once, reused while it matches)
        artifact, _ = prepare("small", ["ort"], 1, args.prompt_len, args.new_tokens, print)
    name = artifact.name
    vocab = artifact.manifest["config"]["vocab_size"]
    max_positions = artifact.manifest["config"]["max_positions"] if args.bad_client else None
    bare = bare_decode(artifact, args.prompt_len, args.new_tokens)
    levels = [int(c) for c in args.clients.split(",")]
    alone = scheduler_alone(artifact, levels, args.requests, args.prompt_len, args.new_tokens, args.vary,
                            args.prefill_chunk)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(artifact.path, args, dynamic=True, log=Path(tmp) / "triton.log")
        try:
            server.wait_ready(f"{name}_stream")
            level(server, f"{name}_stream", 1, 1, args.prompt_len, 4, vocab)  # warm-up
            warm_pss = tree_pss_mb(server.proc.pid)
            print(f"server PSS after warm-up: {warm_pss:.0f} MB", flush=True)
            for clients in levels:
                r = level(server, f"{name}_stream", clients, args.requests, args.prompt_len, args.new_tokens, vocab,
                          max_positions, args.vary)
                results.append(r)
                bad = r["bad_requests"]
                bad_text = (f"  bad requests: {bad['answered_own_error']} own errors, {bad['wrong_answer']} wrong"
                            if bad else "")
                print(f"{clients:>3} clients: {r['tokens_per_s']:7.1f} tok/s  decode {r['decode_tokens_per_s']:7.1f} "
                      f"tok/s  TTFT p50 {r['ttft_p50_ms']:8.1f} p99 {r['ttft_p99_ms']:8.1f} ms  "
                      f"TPOT p50 {r['tpot_p50_ms']:6.1f} p99 {r['tpot_p99_ms']:6.1f} ms  "
                      f"ITL p50 {r['itl_p50_ms']:6.1f} p99 {r['itl_p99_ms']:6.1f} ms  "
                      f"errors {r['errors']}  server PSS {r['server_pss_mb']:.0f} MB{bad_text}", flush=True)
        finally:
            server.stop()
    one = results[0] if results and results[0]["clients"] == 1 else None
    print(f"the model alone (OrtDecoder, one sequence): {bare:.1f} tok/s")
    for r in results:
        r["vs_one_client"] = r["tokens_per_s"] / one["tokens_per_s"] if one else None
        r["decode_vs_one_client"] = r["decode_tokens_per_s"] / one["decode_tokens_per_s"] if one else None
        r["of_bare_decode"] = r["tokens_per_s"] / bare
        r["scheduler_alone"] = alone[r["clients"]]
        if one:
            print(f"{r['clients']:>3} clients: x{r['vs_one_client']:.2f} one client's tok/s, "
                  f"x{r['decode_vs_one_client']:.2f} its decode tok/s")
    print("the in-flight scheduler without Triton: " + ", ".join(
        f"{c} clients {a['tokens_per_s']:.1f} (decode {a['decode_tokens_per_s']:.1f})" for c, a in alone.items())
          + " tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                               "settings": vars(args) | {"artifact": str(artifact.path)},
                                               "bare_decode_tokens_per_s": bare, "server_pss_mb_after_warmup": warm_pss,
                                               "levels": results}, indent=2,
                                              default=str))


if __name__ == "__main__":
    main()
