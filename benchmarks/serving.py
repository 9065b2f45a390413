"""Throughput and tail latency of `moedeploy serve` under 16 concurrent clients, with Triton's
dynamic batching on and off.

The server runs as users run it (`moedeploy serve` in its own process, so its Python
callables do not share a GIL with the clients); the clients are threads here, each with its
own tritonclient connection, each sending `--requests` requests back to back. Block
artifacts get `[--batch, --seq, hidden]` inputs; a decoder artifact is measured through
its `<name>_generate` model (`--seq` prompt tokens, `--new-tokens` greedy tokens). The
average batch per execution comes from Triton's Prometheus counters. Beside each figure
stands its roofline: the requests/s of the model alone on ONNX Runtime, at the batch size
Triton formed, and the fraction the server achieves. Numbers are measured in one run on one
machine, never asserted in tests.

    python benchmarks/serving.py [--artifact DIR] [--clients 16] [--requests 50] [--protocol http] [--packed-weights all] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import numpy as np

HOST = "127.0.0.1"
SERVE = (  # the `moedeploy` app with the serving commands, registered here if it lacks them
    "from moedeploy.cli import app\n"
    "from moedeploy.serving.cli import register\n"
    "if 'serve' not in {c.name for c in app.registered_commands}:\n"
    "    register(app)\n"
    "app()\n"
)


def free_ports(n: int) -> list[int]:
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]


def counter(metrics_url: str, name: str, model: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model="{model}"' in line)


class Server:
    """`moedeploy serve <artifact>` in a subprocess on free loopback ports; SIGTERM on exit."""

    def __init__(self, artifact: Path, args: argparse.Namespace, dynamic: bool, log: Path) -> None:
        self.http, self.grpc, self.metrics = free_ports(3)
        cmd = [sys.executable, "-c", SERVE, "serve", str(artifact), "--backend", args.backend,
               "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
               "--max-queue-delay-us", str(args.max_queue_delay_us), "--instances", str(args.instances),
               "--exit-timeout", "1", "--log-file", str(log)]
        if not dynamic:
            cmd.append("--no-dynamic-batching")
        if args.max_batch_size:
            cmd += ["--max-batch-size", str(args.max_batch_size)]
        if getattr(args, "stream_interval", None):  # benchmarks/serving_stream.py's
            cmd += ["--stream-interval", str(args.stream_interval)]
        if getattr(args, "prefill_chunk", None) is not None:  # benchmarks/serving_stream.py's
            cmd += ["--prefill-chunk", str(args.prefill_chunk)]
        if getattr(args, "packed_weights", None):
            cmd += ["--packed-weights", args.packed_weights]
        # the server's console goes to a file: a pipe nobody reads until the end fills up (64 KiB of
        # "refused a request" lines) and then blocks the server's next log line, and with it the model
        self.console = log.with_name(log.name + ".console")
        with self.console.open("w") as console:
            self.proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, text=True)
        self.url = {"http": f"{HOST}:{self.http}", "grpc": f"{HOST}:{self.grpc}"}
        self.metrics_url = f"http://{HOST}:{self.metrics}/metrics"

    def wait_ready(self, model: str, timeout_s: float = 180) -> None:
        import tritonclient.http as http

        client = http.InferenceServerClient(self.url["http"])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited:\n" + self.console.read_text())
            try:
                if client.is_model_ready(model):
                    return
            except Exception:  # not listening yet
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server was not ready after {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_request(protocol: str, inputs: dict[str, np.ndarray]):
    from tritonclient.utils import np_to_triton_dtype

    module = __import__(f"tritonclient.{protocol}", fromlist=["InferInput"])
    tensors = []
    for name, array in inputs.items():
        t = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        tensors.append(t)
    return module, tensors


def load(server: Server, model: str, protocol: str, inputs: dict[str, np.ndarray], clients: int, requests: int) -> dict:
    """`clients` threads x `requests` back-to-back requests; latency per request, wall time overall."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client_loop() -> None:
        module, tensors = make_request(protocol, inputs)
        client = module.InferenceServerClient(server.url[protocol])
        mine = []
        barrier.wait()
        for _ in range(requests):
            start = time.perf_counter()
            try:
                client.infer(model, tensors)
            except Exception as e:  # counted and reported, the run goes on
                with lock:
                    errors.append(str(e)[:200])
                continue
            mine.append(time.perf_counter() - start)
        client.close()  # in its own thread: gevent's HTTP client must not be torn down from another
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    executions = counter(server.metrics_url, "nv_inference_exec_count", model)
    inferences = counter(server.metrics_url, "nv_inference_count", model)
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    executions = counter(server.metrics_url, "nv_inference_exec_count", model) - executions
    inferences = counter(server.metrics_url, "nv_inference_count", model) - inferences
    ms = sorted(x * 1e3 for x in latencies)
    return {
        "requests": len(latencies), "errors": len(errors), "first_error": errors[0] if errors else None,
        "wall_s": round(wall, 3), "requests_per_s": round(len(latencies) / wall, 1),
        "latency_p50_ms": round(statistics.median(ms), 2) if ms else None,
        "latency_p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2) if ms else None,
        "executions": int(executions), "avg_batch_per_execution": round(inferences / executions, 2) if executions else None,
    }


def bare_ceiling(artifact, inputs: dict[str, np.ndarray], rows: int, new_tokens: int) -> float:
    """The roofline of serving: requests/s of the model alone (ONNX Runtime, no server), when
    `rows` requests are stacked into one execution as Triton's batcher would."""
    import torch

    from moedeploy.bench.machine import median_seconds

    stacked = {k: np.concatenate([v] * rows) for k, v in inputs.items()}
    if artifact.kind == "decoder":
        from moedeploy.runtime.generation import OrtDecoder
        from moedeploy.runtime.quantized import RUN_ACCURACY

        decoder = OrtDecoder(artifact, nbits_accuracy=RUN_ACCURACY)  # a quantized artifact as serve runs it
        ids = torch.from_numpy(stacked["input_ids"])
        seconds = median_seconds(lambda: decoder.generate(ids, max_new_tokens=new_tokens), repeat=10)
    else:
        from moedeploy.runtime.ort import create_session

        session = create_session(artifact)
        seconds = median_seconds(lambda: session.run(stacked), repeat=30)
    return rows / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, default=None, help="default: the tiny MoE block, exported to a temp folder")
    parser.add_argument("--backend", default="ort")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=50, help="per client")
    parser.add_argument("--batch", type=int, default=1, help="rows per request")
    parser.add_argument("--seq", type=int, default=16, help="sequence length (decoder: prompt length)")
    parser.add_argument("--new-tokens", type=int, default=8, help="decoder: greedy tokens per request")
    parser.add_argument("--max-queue-delay-us", type=int, default=500)
    parser.add_argument("--max-batch-size", type=int, default=None)
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--packed-weights", choices=("stream", "all"), default=None,
                        help="serve --packed-weights (a decoder's generate model repacks its weights only with 'all')")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()

    from moedeploy.export import Artifact, export

    with tempfile.TemporaryDirectory(prefix="moedeploy-serving-bench-") as tmp:
        artifact = Artifact.load(args.artifact) if args.artifact else export("moe", Path(tmp) / "moe")
        rng = np.random.default_rng(0)
        if artifact.kind == "decoder":
            model = artifact.name + "_generate"
            vocab = artifact.manifest["config"]["vocab_size"]
            inputs = {"input_ids": rng.integers(0, vocab, (args.batch, args.seq), dtype=np.int64),
                      "max_new_tokens": np.full((args.batch, 1), args.new_tokens, dtype=np.int64)}
        else:
            model = artifact.name
            spec = artifact.manifest["inputs"][0]
            hidden = spec["shape"][-1]
            inputs = {spec["name"]: rng.standard_normal((args.batch, args.seq, hidden)).astype(spec["dtype"])}
        results = []
        for dynamic in (True, False):
            server = Server(artifact.path, args, dynamic, Path(tmp) / f"triton-{dynamic}.log")
            try:
                server.wait_ready(model)
                load(server, model, args.protocol, inputs, clients=2, requests=5)  # warm-up
                result = load(server, model, args.protocol, inputs, args.clients, args.requests)
            finally:
                server.stop()
            rows = max(1, round(result["avg_batch_per_execution"] or 1)) if dynamic else 1
            ceiling = bare_ceiling(artifact, inputs, rows, args.new_tokens) if args.backend == "ort" else None
            result["bare_model_requests_per_s"] = round(ceiling, 1) if ceiling else None
            result["fraction_of_bare_model"] = round(result["requests_per_s"] / ceiling, 3) if ceiling else None
            results.append({"dynamic_batching": dynamic, **result})

    print(f"{artifact.name} -> model {model} ({args.backend}, {args.protocol}), {args.clients} clients x "
          f"{args.requests} requests, input {', '.join(f'{k}{list(v.shape)}' for k, v in inputs.items())}, "
          f"max queue delay {args.max_queue_delay_us} us, {args.instances} instance(s)")
    print(f"{'dynamic batching':<18}{'req/s':>9}{'p50 ms':>10}{'p99 ms':>10}{'avg batch':>11}{'errors':>8}"
          f"{'bare model req/s':>18}{'of bare':>9}")
    for r in results:
        frac = f"{r['fraction_of_bare_model']:.0%}" if r["fraction_of_bare_model"] else "n/a"
        print(f"{'on' if r['dynamic_batching'] else 'off':<18}{r['requests_per_s']:>9}{r['latency_p50_ms']:>10}"
              f"{r['latency_p99_ms']:>10}{r['avg_batch_per_execution']!s:>11}{r['errors']:>8}"
              f"{r['bare_model_requests_per_s']!s:>18}{frac:>9}")
    on, off = results
    if on["requests_per_s"] and off["requests_per_s"]:
        print(f"dynamic batching: throughput x{on['requests_per_s'] / off['requests_per_s']:.2f}, "
              f"p99 latency x{on['latency_p99_ms'] / off['latency_p99_ms']:.2f}")
    if args.json:
        report = {"machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
                  "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "model": model, "results": results}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
