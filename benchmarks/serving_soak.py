"""Soak of `moedeploy serve` under good and bad traffic at once, on loopback, bounded in count
and time.

`--clients` good clients (alternately HTTP and gRPC) each send `--requests` requests to every
model (the tiny MoE block `moe`, the tiny decoder's logits model `decoder` and its
`decoder_generate`), while one bad client sends every malformed class in turn (token ids
outside the vocabulary with the good requests' shapes, bad generation options, a partial KV
cache, rows that disagree, a missing input, empty tensors, prompts and sequences past the
artifact's ranges, and `--big-count` requests of x[1, 819200, 64], 210 MB, per protocol, over the
server's default 64 MiB `--max-request-mb`, so refused by its front before Triton reads them).
Checked and reported:
- every good answer equals eager PyTorch (the block and decoder rebuilt from the seed the
  artifacts were exported with), zero good failures;
- every bad request answered as a client error (HTTP 400 / gRPC INVALID_ARGUMENT; the 210 MB
  ones HTTP 413 / gRPC RESOURCE_EXHAUSTED) with its own one-line reason;
- the good requests' rate (every model, both protocols, beside the bad client);
- the server tree's memory (serve + tritonserver + stubs, summed PSS) after the soak against
  its value after warm-up (the goal: within 10 %);
- SIGTERM afterwards: its duration (< 15 s), every model unloaded, no stub left, and the
  server's PyTriton workspace and /dev/shm regions gone.

    python benchmarks/serving_soak.py [--clients 16] [--requests 50] [--big-count 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from serving import SERVE, free_ports  # the throughput benchmark beside this file

HOST = "127.0.0.1"
SEED = 0
SEQ = 6
NEW_TOKENS = 4
POOL = 8  # distinct good inputs per model (their eager answers are computed once)
CLIENT_ERROR = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
TOO_BIG = {"http": ("413", "is over the server's limit of 67108864 bytes"),  # the front's answers
           "grpc": ("StatusCode.RESOURCE_EXHAUSTED", "larger than max (")}


def tree_pss_mb(pid: int) -> float:
    """Summed PSS of a process and its descendants, in MB: shared memory (the Python backend's
    /dev/shm pool, mapped by tritonserver and a stub) counts once, not once per mapping."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    return total / 1024


def rss_by_process(pid: int) -> dict[str, float]:
    """RSS in MB of the process and each descendant, keyed 'pid name' (where memory stays)."""
    out = {}
    for p in [pid, *descendants(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out[f"{p} {fields['Name'].strip()}"] = round(int(fields.get("VmRSS", "0 kB").split()[0]) / 1024, 1)
    return out


def process_state(pid: int) -> str | None:
    """'(name) state' of a process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.index("("):].split()[0] + " " + stat.rsplit(")", 1)[1].split()[0]


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def client(protocol: str, url: str):
    if protocol == "http":
        import tritonclient.http as module

        return module, module.InferenceServerClient(url, network_timeout=120, connection_timeout=120)
    import tritonclient.grpc as module

    return module, module.InferenceServerClient(url)


def infer(module, conn, model: str, inputs: dict[str, np.ndarray], output: str) -> np.ndarray:
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, array in inputs.items():
        t = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        tensors.append(t)
    return conn.infer(model, tensors, outputs=[module.InferRequestedOutput(output)]).as_numpy(output)


def references(tmp: Path):
    """The two artifacts and, per model, POOL good inputs with eager PyTorch's answers."""
    from moedeploy.export import BLOCKS, export_block, export_decoder
    from moedeploy.export.blocks import build_block
    from moedeploy.models import MoEDecoder, preset

    moe, dec = export_block("moe", tmp / "moe", seed=SEED), export_decoder(tmp / "decoder", seed=SEED)
    block = build_block(BLOCKS["moe"], SEED).eval()
    torch.manual_seed(SEED)
    decoder = MoEDecoder(preset("tiny")).eval()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1 + i % 2, 4, 64, generator=g) for i in range(POOL)]
    ids = [torch.randint(0, 256, (1, SEQ), generator=g) for _ in range(POOL)]
    budget = np.array([[NEW_TOKENS]], np.int64)
    with torch.no_grad():
        pool = {
            "moe": [({"x": x.numpy()}, "y", block(x).numpy()) for x in xs],
            "decoder": [({"input_ids": i.numpy()}, "logits", decoder(i).numpy()) for i in ids],
            "decoder_generate": [({"input_ids": i.numpy(), "max_new_tokens": budget}, "output_ids",
                                  decoder.generate(i, max_new_tokens=NEW_TOKENS).numpy()) for i in ids],
        }
    return [moe.path, dec.path], pool


def bad_requests(big: int) -> list[tuple[str, dict[str, np.ndarray], str, str]]:
    """(model, inputs, output, text its error must contain) for every malformed class."""
    ids = np.array([[1, 2, 3, 4, 5, 6]])
    one = np.array([[1.0]], np.float32)
    cache = {"past_key_values.0.key": np.zeros((1, 2, 3, 16), np.float32)}
    out = {"decoder_generate": "output_ids", "decoder": "logits", "moe": "y"}
    cases = [
        ("decoder_generate", {"input_ids": np.array([[1, 2, 300, 4, 5, 6]])}, "token id 300,"),
        ("decoder", {"input_ids": np.array([[1, 2, 3, 4, 5, 301]])}, "token id 301,"),
        ("decoder", {"input_ids": np.array([[1, 2, 3, 4, 5, -7]])}, "token id -7,"),
        ("decoder_generate", {"input_ids": ids, "max_new_tokens": np.array([[-1]])}, "max_new_tokens must be >= 0"),
        ("decoder_generate", {"input_ids": ids, "max_new_tokens": np.array([[300]])}, "exceeds max_positions"),
        ("decoder_generate", {"input_ids": ids, "temperature": -one}, "temperature"),
        ("decoder_generate", {"input_ids": ids, "temperature": one, "top_p": 1.5 * one}, "top_p must lie in (0, 1]"),
        ("decoder_generate", {"input_ids": ids, "temperature": one, "top_k": np.array([[0]])}, "top_k"),
        ("decoder", {"input_ids": ids, **cache}, "send all 4 past_key_values.* inputs or none"),
        ("decoder_generate", {"input_ids": np.vstack([ids, ids]), "max_new_tokens": np.array([[2], [3]])},
         "must be the same for every sequence"),
        ("decoder_generate", {"max_new_tokens": np.array([[3]])}, "missing required input 'input_ids'"),
        ("decoder_generate", {"input_ids": np.zeros((1, 0), np.int64)}, "is empty"),
        ("moe", {"x": np.zeros((1, 0, 64), np.float32)}, "is empty"),
        ("decoder", {"input_ids": np.zeros((1, 300), np.int64)}, "outside the model's range"),
    ]
    big_x = np.zeros((1, 819200, 64), np.float32)
    cases += [("moe", {"x": big_x}, "too big")] if big else []
    return [(model, inputs, out[model], text) for model, inputs, text in cases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=50, help="per client and model")
    parser.add_argument("--big-count", type=int, default=2, help="210 MB requests per protocol")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="the whole load phase")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="moedeploy-soak-") as tmp:
        paths, pool = references(Path(tmp))
        http, grpc, metrics = free_ports(3)
        log = Path(tmp) / "triton.log"
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, "serve", *map(str, paths), "--http-port", str(http), "--grpc-port", str(grpc),
             "--metrics-port", str(metrics), "--exit-timeout", "5", "--max-queue-delay-us", "2000",
             "--log-file", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        urls = {"http": f"{HOST}:{http}", "grpc": f"{HOST}:{grpc}"}
        try:
            report = soak(proc, urls, pool, args)
            report |= stop(proc, log)
        finally:
            if proc.poll() is None:
                proc.kill()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def wait_ready(proc: subprocess.Popen, urls: dict[str, str]) -> None:
    import tritonclient.http as http

    conn = http.InferenceServerClient(urls["http"])
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited during start-up")
        try:
            if conn.is_server_ready():
                return
        except Exception:  # not listening yet
            pass
        time.sleep(0.1)
    raise TimeoutError("the server was not ready after 180 s")


def soak(proc: subprocess.Popen, urls: dict[str, str], pool: dict, args: argparse.Namespace) -> dict:
    wait_ready(proc, urls)
    for protocol in urls:  # warm-up: every model once per protocol
        module, conn = client(protocol, urls[protocol])
        for model, cases in pool.items():
            infer(module, conn, model, cases[0][0], cases[0][1])
        conn.close()
    time.sleep(1.0)
    base, base_parts = tree_pss_mb(proc.pid), rss_by_process(proc.pid)
    peak = [base]
    start = time.monotonic()
    finished = threading.Event()

    def sample() -> None:
        while not finished.wait(0.5):
            peak.append(tree_pss_mb(proc.pid))

    def good(c: int) -> dict:
        protocol = ("http", "grpc")[c % 2]
        module, conn = client(protocol, urls[protocol])
        stats = {"sent": 0, "failed": [], "wrong": 0}
        try:
            for i in range(args.requests):
                for model, cases in pool.items():
                    if time.monotonic() - start > args.deadline_s:
                        stats["failed"].append("deadline")
                        return stats
                    inputs, output, expected = cases[(c + i) % POOL]
                    stats["sent"] += 1
                    try:
                        got = infer(module, conn, model, inputs, output)
                    except Exception as e:
                        stats["failed"].append(f"{model}: {str(e)[:200]}")
                        continue
                    exact = model == "decoder_generate"
                    ok = np.array_equal(got, expected) if exact else np.allclose(got, expected, atol=1e-4, rtol=1e-4)
                    stats["wrong"] += int(got.shape != expected.shape or not ok)
        finally:
            conn.close()
        return stats

    def bad(done: threading.Event) -> dict:
        from tritonclient.utils import InferenceServerException

        stats = {"sent": 0, "wrong_answer": []}
        cases = bad_requests(args.big_count)
        conns = {p: client(p, urls[p]) for p in urls}
        k, big_sent = 0, dict.fromkeys(urls, 0)
        try:
            while not done.is_set() and stats["sent"] < 4000 and time.monotonic() - start < args.deadline_s:
                model, inputs, output, text = cases[k % len(cases)]
                protocol = ("http", "grpc")[(k // len(cases)) % 2]
                k += 1
                if sum(a.nbytes for a in inputs.values()) > 2**27:  # a 210 MB request: --big-count per protocol
                    if big_sent[protocol] >= args.big_count:
                        continue
                    big_sent[protocol] += 1
                module, conn = conns[protocol]
                stats["sent"] += 1
                try:
                    infer(module, conn, model, inputs, output)
                    stats["wrong_answer"].append(f"{model}: answered ({text})")
                except InferenceServerException as e:
                    status, message = str(e.status()), e.message()
                    expected, text = TOO_BIG[protocol] if text == "too big" else (CLIENT_ERROR[protocol], text)
                    if status != expected or text not in message or "\n" in message.strip():
                        stats["wrong_answer"].append(f"{protocol} {model} [{text}]: {status} {message[:200]}")
        finally:
            for _, conn in conns.values():
                conn.close()
        return stats

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    done = threading.Event()
    with ThreadPoolExecutor(args.clients + 1) as threads:
        bad_future = threads.submit(bad, done)
        good_stats = list(threads.map(good, range(args.clients)))
        done.set()
        bad_stats = bad_future.result()
    load_s = time.monotonic() - start
    finished.set()
    time.sleep(2.0)
    after, after_parts = tree_pss_mb(proc.pid), rss_by_process(proc.pid)
    failed = [f for s in good_stats for f in s["failed"]]
    return {
        "good_requests": sum(s["sent"] for s in good_stats), "good_failed": len(failed), "good_failures": failed[:10],
        "good_wrong": sum(s["wrong"] for s in good_stats),
        "bad_requests": bad_stats["sent"], "bad_misanswered": len(bad_stats["wrong_answer"]),
        "bad_misanswers": bad_stats["wrong_answer"][:10],
        "load_s": round(load_s, 1), "good_per_s": round(sum(s["sent"] for s in good_stats) / load_s, 1), "pss_after_warmup_mb": round(base, 1), "pss_peak_mb": round(max(peak), 1),
        "pss_after_soak_mb": round(after, 1), "pss_change_pct": round(100 * (after - base) / base, 1),
        "rss_by_process_after_warmup_mb": base_parts, "rss_by_process_after_soak_mb": after_parts,
    }


def stop(proc: subprocess.Popen, log: Path) -> dict:
    """SIGTERM; how long it took and what it left behind."""
    from pytriton.constants import PYTRITON_HOME

    workspaces = [w.parent for w in Path(PYTRITON_HOME).glob("workspace_*/moedeploy-owner")
                  if w.read_text().split()[0] == str(proc.pid)]
    shm = list(Path("/dev/shm").glob(f"pytrtion{proc.pid}-*"))
    children = descendants(proc.pid)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    took = time.monotonic() - start
    time.sleep(1.0)
    text = log.read_text()
    return {
        "sigterm_s": round(took, 2), "exit_code": proc.returncode,
        "models_unloaded": sorted(m for m in ("moe", "decoder", "decoder_generate") if f"successfully unloaded '{m}'" in text),
        "exit_timeout_expired": "Exit timeout expired" in text,
        "processes_left": [f"{p} {stat}" for p in children if (stat := process_state(p)) and " Z" not in stat],
        "workspace_left": [str(w) for w in workspaces if w.exists()],
        "shm_left": [str(r) for r in shm if r.exists()],
        "tmp_folder_loads": text.count("/tmp/folder"),
    }


if __name__ == "__main__":
    main()
