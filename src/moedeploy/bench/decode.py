"""Prefill latency, decode speed, per-token latency and peak memory of one backend.

Each backend runs in its own Python process (`python -m moedeploy.bench.decode '<json>'`),
so its peak RSS is its own and no backend warms another's caches. Every backend runs the
same greedy loop on the same seeded prompt; the generated tokens come back too, so the
benchmark also shows that the backends agree. Each backend picks its greedy token the
cheapest way its runtime offers, as a user's greedy decode would: ONNX Runtime in its graph
(`OrtDecoder.greedy_step`), llama.cpp and OpenVINO by NumPy's argmax over the logits where
the runtime left them, every other backend by the generation loop's argmax of its logits.
"""

from __future__ import annotations

import gc
import json
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

Step = Callable[[torch.Tensor, int], torch.Tensor]
#: reset(batch, total), step(ids, start) -> (B, V) last-position logits, greedy(ids, start) -> (B, 1) next ids
Stepper = tuple[Callable[[int, int], None], Step, Step]


def argmax_greedy(step: Step) -> Step:
    """The greedy choice of a backend with no cheaper one: the argmax of its step's logits, as
    moedeploy's generation loop takes it (NumPy's on the CPU, torch.argmax's index)."""
    from moedeploy.models.generation import greedy_argmax

    return lambda ids, start: greedy_argmax(step(ids, start).float())[:, None]


@dataclass
class Settings:
    artifact: str
    backend: str
    batch: int = 1
    prompt_len: int = 128
    new_tokens: int = 64
    threads: int = 2
    repeat: int = 3
    seed: int = 0
    checkpoint: str | None = None  # eager torch reads this folder (else the one the manifest names)
    peer_model: str | None = None  # the weights in a peer's own format (llama.cpp: a GGUF; openvino: a compressed IR)
    peer_extra_buffers: bool = True  # llama.cpp: its AMX / repacked weight buffers (off after they crash)


def _reset_peak_rss() -> None:
    """Forget the load phase's peak (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss_mb(field: str = "VmRSS:") -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _peak_rss_mb() -> float:
    peak = _rss_mb("VmHWM:")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _torch_stepper(artifact, compile_model: bool, checkpoint: str | None = None) -> Stepper:
    from moedeploy.export.reference import build_decoder, eager_decoder
    from moedeploy.models.weights import ModuleWeights

    source = artifact.manifest["config"].get("source", {})
    checkpoint = checkpoint or source.get("checkpoint")
    model = build_decoder(None if checkpoint else source.get("preset"), checkpoint, artifact.manifest["seed"],
                          torch.float32)
    # a quantized artifact's eager twin runs on the weights as its DequantizeLinear nodes give them
    model = eager_decoder(ModuleWeights(model), artifact.manifest, torch.float32, model)
    forward = torch.compile(model, dynamic=True) if compile_model else model
    state = {}

    def reset(batch: int, total: int) -> None:
        state["cache"] = model.new_cache(batch, total)

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        with torch.inference_mode():
            return forward(ids, state["cache"], start)[:, -1]

    return reset, step, argmax_greedy(step)


def _hf_stepper(artifact) -> Stepper:
    """Hugging Face transformers' eager Mixtral with the same shapes (random weights)."""
    from transformers import DynamicCache, MixtralConfig, MixtralForCausalLM

    c = artifact.manifest["config"]
    config = MixtralConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["expert_hidden"],
        num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
        num_local_experts=c["n_experts"], num_experts_per_tok=c["top_k"], max_position_embeddings=c["max_positions"],
        rms_norm_eps=c["norm_eps"], head_dim=c["head_dim"],
    )
    torch.manual_seed(artifact.manifest["seed"])
    model = MixtralForCausalLM(config).eval()
    state = {}

    def reset(batch: int, total: int) -> None:
        state["cache"] = DynamicCache(config=config)

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        with torch.inference_mode():
            return model(ids, past_key_values=state["cache"], use_cache=True, logits_to_keep=1).logits[:, -1]

    return reset, step, argmax_greedy(step)


def _ort_stepper(artifact, threads: int, attention: str = "graph", moe: str = "auto") -> Stepper:
    from moedeploy.runtime.generation import OrtDecoder
    from moedeploy.runtime.quantized import RUN_ACCURACY

    # generation reads the last position's logits only: so do transformers (logits_to_keep=1) and
    # llama.cpp; and greedy decoding their argmax only, which the graph takes (logits="greedy").
    # With GroupQueryAttention the cache is appended to in place (IO-bound buffers)
    # (a quantized artifact at the level it is served at: int8 activations, as llama.cpp's q8_0/q4_0;
    # the level changes nothing in a float graph)
    decoder = OrtDecoder(artifact, threads=threads, attention_lowering=attention, moe_lowering=moe, logits="greedy",
                         kv_cache="inplace" if attention == "gqa" else "copy", nbits_accuracy=RUN_ACCURACY)

    def reset(batch: int, total: int) -> None:
        decoder.reset(batch, total)

    reset.lowering = decoder.lowering  # type: ignore[attr-defined]  # what the session runs, into the result
    return reset, lambda ids, start: decoder.step(ids, start)[:, -1], lambda ids, start: decoder.greedy_step(ids, start)[:, None]


def stepper(settings: Settings, artifact) -> Stepper:
    if settings.backend == "torch":
        return _torch_stepper(artifact, compile_model=False, checkpoint=settings.checkpoint)
    if settings.backend == "torch-compile":
        return _torch_stepper(artifact, compile_model=True, checkpoint=settings.checkpoint)
    if settings.backend == "hf":
        return _hf_stepper(artifact)
    if settings.backend == "ort":
        return _ort_stepper(artifact, settings.threads)
    if settings.backend == "ort-gqa":
        return _ort_stepper(artifact, settings.threads, attention="gqa")
    if settings.backend == "ort-gqa-experts":
        return _ort_stepper(artifact, settings.threads, attention="gqa", moe="experts")
    if settings.backend == "ort-contrib":
        return _ort_stepper(artifact, settings.threads, moe="contrib")
    if settings.backend == "llama.cpp":
        from moedeploy.bench.peers import llama_cpp_stepper

        return llama_cpp_stepper(settings.peer_model, settings.threads, settings.prompt_len + settings.new_tokens,
                                 settings.prompt_len, settings.peer_extra_buffers)
    if settings.backend == "openvino":
        from moedeploy.bench.openvino_peer import openvino_stepper

        return openvino_stepper(artifact, settings.threads, settings.peer_model)
    if settings.backend == "trt":
        from moedeploy.runtime.generation import TrtDecoder

        decoder = TrtDecoder(artifact)  # says in one line what is missing without TensorRT or a GPU
        def step(ids: torch.Tensor, start: int) -> torch.Tensor:
            return decoder.step(ids, start)[:, -1]

        return lambda batch, total: decoder.reset(batch), step, argmax_greedy(step)
    raise ValueError(f"unknown backend {settings.backend!r}")


def run(settings: Settings) -> dict:
    """The measurement itself (called inside the worker process), then the memory bandwidth of
    that moment: on a shared machine it drifts between backends' turns, and the fraction of the
    bound uses this one. The backend is gone by then (ONNX Runtime's spinning thread pool would
    take a core from the probe), and its peak memory read (the probe's buffer would raise it)."""
    from moedeploy.bench.machine import measure_bandwidth_gbs

    result = _timed(settings)
    gc.unfreeze()
    gc.collect()
    return result | {"bandwidth_gbs": measure_bandwidth_gbs(settings.threads)}


def _timed(settings: Settings) -> dict:
    from moedeploy.export.artifact import Artifact

    torch.set_num_threads(settings.threads)
    artifact = Artifact.load(settings.artifact, verify=False)
    # the worker's own interpreter, torch and moedeploy, before the backend loads anything: what
    # every backend's peak shares, so peak minus this is the backend's own (weights, runtime, cache)
    baseline = _rss_mb() or 0.0
    load_start = time.perf_counter()
    reset, _, greedy = stepper(settings, artifact)
    load_s = time.perf_counter() - load_start
    load_peak = _peak_rss_mb()
    vocab = artifact.manifest["config"]["vocab_size"]
    prompt = torch.randint(0, vocab, (settings.batch, settings.prompt_len), generator=torch.Generator().manual_seed(settings.seed))
    total = settings.prompt_len + settings.new_tokens

    def generate(new_tokens: int) -> tuple[float, list[float], list[list[int]]]:
        reset(settings.batch, total)
        start = time.perf_counter()
        token = greedy(prompt, 0)
        prefill = time.perf_counter() - start
        tokens, latencies = [token], []
        for i in range(new_tokens - 1):
            start = time.perf_counter()
            token = greedy(token, settings.prompt_len + i)
            latencies.append(time.perf_counter() - start)
            tokens.append(token)
        return prefill, latencies, torch.cat(tokens, 1).tolist()

    # what loading made stays alive: out of the collector's way, so its full passes during the timed
    # loop walk only what the loop allocates (the same for every backend)
    gc.collect()
    gc.freeze()
    generate(min(8, settings.new_tokens))  # warm-up: allocators, thread pools, compilation
    _reset_peak_rss()
    prefills, rates, all_latencies = [], [], []
    for _ in range(settings.repeat):
        prefill, latencies, tokens = generate(settings.new_tokens)
        prefills.append(prefill * 1e3)
        rates.append(settings.batch * len(latencies) / sum(latencies) if latencies else 0.0)
        all_latencies += [t * 1e3 for t in latencies]
    ordered = sorted(all_latencies) or [0.0]
    return {
        "backend": settings.backend,
        "prefill_ms": statistics.median(prefills),
        "prefill_ms_all": prefills,
        "decode_tokens_per_s": statistics.median(rates),
        "decode_tokens_per_s_all": rates,
        "token_latency_p50_ms": ordered[len(ordered) // 2],
        "token_latency_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "peak_rss_mb": (peak := _peak_rss_mb()),
        "baseline_rss_mb": baseline,
        "backend_rss_mb": max(peak, load_peak) - baseline,
        "load_peak_rss_mb": load_peak,
        "load_s": load_s,
        "tokens": tokens,
    } | ({"lowering": lowering} if (lowering := getattr(reset, "lowering", None)) else {})


if __name__ == "__main__":
    print(json.dumps(run(Settings(**json.loads(sys.argv[1])))))


def run_in_subprocess(settings: Settings, timeout: float = 1800) -> dict:
    """One backend's run in a fresh process. Every backend's worker, peers included, starts with
    the huge pages the `moedeploy` command gives itself (moedeploy/utils/huge_pages.py), so all
    are timed as they run under moedeploy, and the bandwidth each worker measures is read in the
    same pages as its weights. A llama.cpp worker that crashed runs once more without its extra
    weight buffers (`retry_llama_without_extra_buffers`)."""
    return retry_llama_without_extra_buffers(lambda s: _worker(s, timeout), settings)


def retry_llama_without_extra_buffers(run: Callable[[Settings], dict], settings: Settings) -> dict:
    """`run(settings)`, and for a llama.cpp worker that crashed (a signal in `peers.CRASH_SIGNALS`,
    not a kill from outside), `run` again with its AMX / repacked weight buffers off
    (`peers.with_extra_buffers_fallback`): those segfault on some AMX hosts
    (ggml-org/llama.cpp#20824), and a peer comparison that loses its quantized llama.cpp rows to
    that says nothing. The retried result says what happened (`note`, `llama_extra_buffers:
    false`), and so does each report that prints it."""
    from dataclasses import replace

    from moedeploy.bench.peers import CRASH_SIGNALS, with_extra_buffers_fallback

    result, note = with_extra_buffers_fallback(
        lambda extra: run(settings if extra == settings.peer_extra_buffers else replace(settings, peer_extra_buffers=extra)),
        lambda r: r["error"] if settings.backend == "llama.cpp" and r.get("signal") in CRASH_SIGNALS else None,
        settings.peer_extra_buffers)
    return result if note is None else result | {"llama_extra_buffers": False, "note": note}


def keeps_extra_buffers(earlier_rounds: list[dict]) -> bool:
    """Whether a backend's next round starts with llama.cpp's extra weight buffers on: not once a
    round had to run without them (each round would crash again, and its rounds would mix the two)."""
    return all(r.get("llama_extra_buffers", True) for r in earlier_rounds)


def _worker(settings: Settings, timeout: float) -> dict:
    import os
    import subprocess

    from moedeploy.utils.child_process import crash_text
    from moedeploy.utils.huge_pages import with_huge_pages

    done = subprocess.run(
        [sys.executable, "-m", "moedeploy.bench.decode", json.dumps(asdict(settings))],
        capture_output=True, text=True, timeout=timeout, check=False, cwd=Path.cwd(),
        env=with_huge_pages(os.environ),
    )
    if done.returncode:
        if (crash := crash_text(done.returncode)) is not None:  # no Python line to show: name the signal
            return {"backend": settings.backend, "error": f"its worker was {crash}", "signal": -done.returncode}
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit code {done.returncode}"
        return {"backend": settings.backend, "error": re.sub(r"^[\w.]+(Error|Exception|Unavailable): ", "", last)}
    return json.loads(done.stdout.strip().splitlines()[-1])
