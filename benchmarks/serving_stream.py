"""Streaming generation under load: `moedeploy serve`'s `<name>_stream` with 1, 4, 16 and 32
concurrent gRPC streaming clients.

The server runs in its own process (`moedeploy serve`, as users run it); each client is a
thread with its own tritonclient gRPC stream, sending `--requests` requests one after another
(`--prompt-len` random prompt ids, `--new-tokens` greedy tokens). Per level: aggregate decode
tokens/s (every token received / the level's wall time), time to first token (request sent ->
first response) and inter-token latency (gaps between one request's responses), p50 and p99,
and the speed of one client for comparison. Beside them, the roofline: the model alone on ONNX
Runtime, one sequence at a time (tokens/s of a bare decode loop in this process). Measured in
one run on one machine, never asserted in tests.

    python benchmarks/serving_stream.py [--artifact DIR] [--clients 1,4,16,32] [--json out.json]
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
from serving import Server  # the `moedeploy serve` subprocess of benchmarks/serving.py


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def one_stream(client, model: str, prompt: np.ndarray, new_tokens: int, answers: queue.Queue) -> tuple[float, list[float]]:
    """(time to first token, arrival times) of one streamed request on an open gRPC stream."""
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
        arrivals.append(arrived)


def level(server: Server, model: str, clients: int, requests: int, prompt_len: int, new_tokens: int,
          vocab: int) -> dict:
    import tritonclient.grpc as grpcclient

    ttft, itl, tokens, errors = [], [], [0], []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client_loop(seed: int) -> None:
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.url["grpc"])
        client.start_stream(callback=lambda result, error: answers.put((time.perf_counter(), result, error)))
        rng = np.random.default_rng(seed)
        barrier.wait()
        for _ in range(requests):
            prompt = rng.integers(0, vocab, prompt_len, dtype=np.int64)
            try:
                first, arrivals = one_stream(client, model, prompt, new_tokens, answers)
            except Exception as e:  # counted and reported, the run goes on
                with lock:
                    errors.append(str(e)[:200])
                continue
            with lock:
                ttft.append(first)
                itl.extend(np.diff(arrivals).tolist())
                tokens[0] += len(arrivals)
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
    return {
        "clients": clients, "requests": clients * requests, "errors": len(errors), "first_errors": errors[:3],
        "tokens": tokens[0], "wall_s": wall, "tokens_per_s": tokens[0] / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99),
    }


def bare_decode(artifact, prompt_len: int, new_tokens: int) -> float:
    """Tokens/s of the model alone: OrtDecoder's greedy loop, one sequence, in this process."""
    import torch

    from moedeploy.runtime.generation import OrtDecoder

    decoder = OrtDecoder(artifact, threads=2, logits="last")
    prompt = torch.randint(0, decoder.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    decoder.generate(prompt, max_new_tokens=4)  # warm-up
    start = time.perf_counter()
    decoder.generate(prompt, max_new_tokens=new_tokens)
    return new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, default=None, help="a decoder artifact (default: the 'small' preset, "
                        "exported once into moedeploy's cache as `moedeploy bench small` does)")
    parser.add_argument("--clients", default="1,4,16,32", help="comma-separated concurrency levels")
    parser.add_argument("--requests", type=int, default=2, help="per client and level")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--backend", default="ort")
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
    bare = bare_decode(artifact, args.prompt_len, args.new_tokens)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(artifact.path, args, dynamic=True, log=Path(tmp) / "triton.log")
        try:
            server.wait_ready(f"{name}_stream")
            level(server, f"{name}_stream", 1, 1, args.prompt_len, 4, vocab)  # warm-up
            for clients in (int(c) for c in args.clients.split(",")):
                r = level(server, f"{name}_stream", clients, args.requests, args.prompt_len, args.new_tokens, vocab)
                results.append(r)
                print(f"{clients:>3} clients: {r['tokens_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:8.1f} "
                      f"p99 {r['ttft_p99_ms']:8.1f} ms  ITL p50 {r['itl_p50_ms']:6.1f} p99 {r['itl_p99_ms']:6.1f} ms  "
                      f"errors {r['errors']}", flush=True)
        finally:
            server.stop()
    one = results[0]["tokens_per_s"] if results and results[0]["clients"] == 1 else None
    print(f"the model alone (OrtDecoder, one sequence): {bare:.1f} tok/s")
    for r in results:
        r["vs_one_client"] = r["tokens_per_s"] / one if one else None
        r["of_bare_decode"] = r["tokens_per_s"] / bare
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                               "settings": vars(args) | {"artifact": str(artifact.path)},
                                               "bare_decode_tokens_per_s": bare, "levels": results}, indent=2,
                                              default=str))


if __name__ == "__main__":
    main()
