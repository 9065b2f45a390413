"""Peers in `moedeploy bench`: the GGUF that llama.cpp reads, interleaved rounds, and the checks before any work."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moedeploy.bench.decode import argmax_greedy
from moedeploy.models import MoEDecoder, preset
from moedeploy.models.weights import ModuleWeights

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
#: the peers' modules, made absent (find_spec answers None) where a test wants no peer installed
PEER_MODULES = ("llama_cpp", "openvino")


def _rotate(x: torch.Tensor, pos: int, base: float, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """Rotary written out: pair i, features (a, b), turns by pos * base^(-2i/d)."""
    d = x.shape[-1]
    out = x.clone()
    for i, (a, b) in enumerate(pairs):
        angle = pos * base ** (-2 * i / d)
        c, s = np.cos(angle), np.sin(angle)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def _rotate_half_split(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """As Hugging Face's Llama computes it: feature i turns with i + d/2."""
    d = x.shape[-1]
    return _rotate(x, pos, base, [(i, i + d // 2) for i in range(d // 2)])


def _rotate_neighbours(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """As llama.cpp's llama architecture computes it (GPT-J style): feature 2i turns with 2i + 1."""
    d = x.shape[-1]
    return _rotate(x, pos, base, [(2 * i, 2 * i + 1) for i in range(d // 2)])


def test_reordered_rows_make_neighbour_rotary_give_the_same_attention_scores() -> None:
    from moedeploy.bench.gguf import rotary_rows_for_llama_cpp

    torch.manual_seed(0)
    heads, d, hidden, base = 3, 8, 10, 10000.0
    wq, wk = torch.randn(heads * d, hidden, dtype=torch.float64), torch.randn(heads * d, hidden, dtype=torch.float64)
    x_q, x_k = torch.randn(hidden, dtype=torch.float64), torch.randn(hidden, dtype=torch.float64)
    pq, pk = 7, 3
    ours_q = _rotate_half_split((wq @ x_q).reshape(heads, d), pq, base)
    ours_k = _rotate_half_split((wk @ x_k).reshape(heads, d), pk, base)
    theirs_q = _rotate_neighbours((rotary_rows_for_llama_cpp(wq, heads) @ x_q).reshape(heads, d), pq, base)
    theirs_k = _rotate_neighbours((rotary_rows_for_llama_cpp(wk, heads) @ x_k).reshape(heads, d), pk, base)
    torch.testing.assert_close((theirs_q * theirs_k).sum(-1), (ours_q * ours_k).sum(-1), rtol=1e-12, atol=1e-12)
    # and the order itself, by hand: head 1's row 2 is its row 1, its row 3 is its row 1 + d/2
    reordered = rotary_rows_for_llama_cpp(wq, heads)
    assert torch.equal(reordered[d + 2], wq[d + 1]) and torch.equal(reordered[d + 3], wq[d + 1 + d // 2])
    # without the reorder the scores differ: the test can tell
    plain_q = _rotate_neighbours((wq @ x_q).reshape(heads, d), pq, base)
    plain_k = _rotate_neighbours((wk @ x_k).reshape(heads, d), pk, base)
    assert not torch.allclose((plain_q * plain_k).sum(-1), (ours_q * ours_k).sum(-1))


def test_gguf_holds_every_weight_and_the_hyperparameters_llama_cpp_reads(tmp_path: Path) -> None:
    from gguf import GGUFReader

    from moedeploy.bench.gguf import recorded_fingerprint, rotary_rows_for_llama_cpp, write_gguf

    config = preset("tiny")
    torch.manual_seed(0)
    model = MoEDecoder(config).eval()
    path = write_gguf(config, ModuleWeights(model), tmp_path / "m.gguf", "f" * 64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "m.gguf.sha256"]  # no temp file left
    assert recorded_fingerprint(path) == "f" * 64
    reader = GGUFReader(path)
    fields = {name: reader.get_field(name).contents() for name in (
        "general.architecture", "llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
        "llama.attention.head_count", "llama.attention.head_count_kv", "llama.expert_count", "llama.expert_used_count",
        "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.context_length")}
    assert fields == pytest.approx({
        "general.architecture": "llama", "llama.block_count": config.n_layers, "llama.embedding_length": config.hidden_size,
        "llama.feed_forward_length": config.expert_hidden, "llama.attention.head_count": config.n_heads,
        "llama.attention.head_count_kv": config.n_kv_heads, "llama.expert_count": config.n_experts,
        "llama.expert_used_count": config.top_k, "llama.rope.freq_base": config.rope_theta,
        "llama.attention.layer_norm_rms_epsilon": config.norm_eps, "llama.context_length": config.max_positions})
    assert len(reader.get_field("tokenizer.ggml.tokens").contents()) == config.vocab_size
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    state = model.state_dict()
    assert len(tensors) == 3 + 10 * config.n_layers
    torch.testing.assert_close(tensors["token_embd.weight"], state["embed.weight"], rtol=0, atol=0)
    torch.testing.assert_close(tensors["output.weight"], state["lm_head.weight"], rtol=0, atol=0)
    layer = config.n_layers - 1
    torch.testing.assert_close(tensors[f"blk.{layer}.attn_q.weight"],
                               rotary_rows_for_llama_cpp(state[f"layers.{layer}.attn.wq.weight"], config.n_heads), rtol=0, atol=0)
    torch.testing.assert_close(tensors[f"blk.{layer}.attn_k.weight"],
                               rotary_rows_for_llama_cpp(state[f"layers.{layer}.attn.wk.weight"], config.n_kv_heads), rtol=0, atol=0)
    for theirs, ours in (("attn_v", "attn.wv.weight"), ("ffn_gate_inp", "ffn.router.weight"), ("ffn_gate_exps", "ffn.w_gate"),
                         ("ffn_up_exps", "ffn.w_up"), ("ffn_down_exps", "ffn.w_down"), ("ffn_norm", "ffn_norm.weight")):
        torch.testing.assert_close(tensors[f"blk.{layer}.{theirs}.weight"], state[f"layers.{layer}.{ours}"], rtol=0, atol=0)


@pytest.mark.parametrize(("change", "named"), [
    ({"qkv_bias": True}, "qkv_bias"),
    ({"sliding_window": 16}, "sliding_window"),
    ({"scoring": "sigmoid", "score_bias": True}, "scoring, score_bias"),
    ({"family": "qwen3_moe"}, "family 'qwen3_moe'"),
])
def test_llama_cpp_refuses_what_its_llama_architecture_would_compute_differently(change: dict, named: str) -> None:
    from moedeploy.bench.peers import check_config

    config = dataclasses.replace(preset("tiny"), **change)
    with pytest.raises(ValueError, match=rf"Mixtral-shaped decoders only, and this one has (options )?{named}"):
        check_config("llama.cpp", config, batch=1)
    with pytest.raises(ValueError, match="--batch 1"):
        check_config("llama.cpp", preset("tiny"), batch=2)
    check_config("llama.cpp", preset("tiny"), batch=1)  # the plain Mixtral shape passes


def test_a_peer_added_by_peers_is_left_out_for_a_model_it_cannot_run() -> None:
    """--peers on a Qwen3-MoE: llama.cpp is dropped with the reason; named in --backend, it is an error."""
    from moedeploy.bench.api import check_peers

    qwen = dataclasses.replace(preset("tiny"), family="qwen3_moe", qk_norm="head")
    backends, optional = ["ort", "llama.cpp"], {"llama.cpp": ""}
    check_peers(qwen, backends, 1, optional)
    assert backends == ["ort"]
    assert optional["llama.cpp"].startswith("llama.cpp is benchmarked on Mixtral-shaped decoders only")
    with pytest.raises(ValueError, match="Mixtral-shaped decoders only"):
        check_peers(qwen, ["ort", "llama.cpp"], 1)


def _result(backend: str, rates: list[float], prefills: list[float], peak: float, tokens: list) -> dict:
    return {"backend": backend, "prefill_ms": float(np.median(prefills)), "prefill_ms_all": prefills,
            "decode_tokens_per_s": float(np.median(rates)), "decode_tokens_per_s_all": rates,
            "token_latency_p50_ms": 10.0, "token_latency_p99_ms": 12.0, "peak_rss_mb": peak,
            "load_peak_rss_mb": peak / 2, "load_s": 0.5, "baseline_rss_mb": 100.0, "bandwidth_gbs": 10.0,
            "backend_rss_mb": peak - 100.0, "tokens": tokens}


def test_rounds_pool_every_timed_run_and_keep_the_highest_peak() -> None:
    from moedeploy.bench.api import merge_rounds

    merged = merge_rounds([_result("ort", [10.0, 30.0], [5.0, 9.0], 300.0, [[1, 2]]),
                           _result("ort", [20.0, 40.0, 50.0], [6.0, 7.0, 8.0], 320.0, [[1, 2]])])
    assert merged["decode_tokens_per_s_all"] == [10.0, 30.0, 20.0, 40.0, 50.0]
    assert merged["decode_tokens_per_s"] == 30.0 and merged["prefill_ms"] == 7.0
    assert merged["decode_tokens_per_s_rounds"] == [20.0, 40.0]  # each round's median, for paired ratios
    assert merged["peak_rss_mb"] == 320.0 and merged["load_peak_rss_mb"] == 160.0
    differ = merge_rounds([_result("ort", [1.0], [1.0], 1.0, [[1, 2]]), _result("ort", [1.0], [1.0], 1.0, [[1, 3]])])
    assert differ == {"backend": "ort", "error": "its rounds generated different greedy tokens"}
    failed = merge_rounds([_result("ort", [1.0], [1.0], 1.0, [[1]]), {"backend": "ort", "error": "boom"}])
    assert failed == {"backend": "ort", "error": "boom"}


def test_a_round_run_without_llama_cpps_extra_buffers_marks_the_merged_row() -> None:
    from moedeploy.bench.api import merge_rounds

    plain = _result("llama.cpp", [2.0], [1.0], 1.0, [[1]]) | {"note": "buffers off", "llama_extra_buffers": False}
    merged = merge_rounds([_result("llama.cpp", [1.0], [1.0], 1.0, [[1]]), plain])
    assert merged["note"] == "buffers off" and merged["llama_extra_buffers"] is False
    assert "note" not in merge_rounds([_result("ort", [1.0], [1.0], 1.0, [[1]])] * 2)


def test_a_worker_killed_by_a_signal_is_named_by_the_signal() -> None:
    """A real child killed by SIGSEGV: its return code is -11, read as the signal's name."""
    import signal
    import subprocess
    import sys

    from moedeploy.utils.child_process import crash_text

    done = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"],
                          capture_output=True, check=False)
    assert done.returncode == -signal.SIGSEGV
    assert crash_text(done.returncode) == "killed by SIGSEGV (signal 11)"
    assert crash_text(1) is None and crash_text(0) is None


def test_llama_cpp_killed_by_a_signal_runs_again_without_its_extra_buffers() -> None:
    """The retry policy: llama.cpp's worker that crashed (SIGSEGV) runs once more with
    peer_extra_buffers off and says so; one killed from outside (SIGKILL: the OOM killer, a user),
    an error that is not a crash, or another backend's crash is reported as it is."""
    from moedeploy.bench.decode import (
        Settings,
        keeps_extra_buffers,
        retry_llama_without_extra_buffers,
    )
    from moedeploy.bench.peers import plain_buffers_note

    calls: list[bool] = []

    def killed_with_extra_buffers(signal_number: int):
        def run(settings: Settings) -> dict:
            calls.append(settings.peer_extra_buffers)
            if settings.peer_extra_buffers:
                return {"backend": settings.backend, "error": f"its worker was killed by X (signal {signal_number})",
                        "signal": signal_number}
            return {"backend": settings.backend, "decode_tokens_per_s": 5.0}
        return run

    result = retry_llama_without_extra_buffers(killed_with_extra_buffers(11), Settings("a", "llama.cpp"))
    assert calls == [True, False]
    assert result["decode_tokens_per_s"] == 5.0 and result["llama_extra_buffers"] is False
    assert result["note"] == plain_buffers_note("its worker was killed by X (signal 11)")
    assert result["note"].startswith("its worker was killed by X (signal 11) with its extra weight buffers")
    assert not keeps_extra_buffers([{"decode_tokens_per_s": 1.0}, result])  # later rounds start without them
    assert keeps_extra_buffers([{"decode_tokens_per_s": 1.0}]) and keeps_extra_buffers([])
    for backend, signal_number in (("llama.cpp", 9), ("ort", 11)):
        calls.clear()
        crashed = retry_llama_without_extra_buffers(killed_with_extra_buffers(signal_number), Settings("a", backend))
        assert calls == [True] and crashed["signal"] == signal_number
    calls.clear()
    failed = retry_llama_without_extra_buffers(lambda s: calls.append(s.peer_extra_buffers) or {"error": "bad file"},
                                               Settings("a", "llama.cpp"))
    assert calls == [True] and failed == {"error": "bad file"}


def test_stream_logits_in_a_child_survive_its_crash_and_name_what_happened() -> None:
    """Children that really crash, fail and hang: the parent goes on, retries a crash without the
    extra buffers (with the note), and says in one line what it got instead of logits."""
    from moedeploy.bench.peers import llama_stream_logits_in_child, plain_buffers_note
    from tests.child_stand_ins import (
        always_segfaults,
        raises_value_error,
        segfaults_with_extra_buffers,
        sleeps,
    )

    value, note = llama_stream_logits_in_child("m.gguf", [1, 2], 2, compute=segfaults_with_extra_buffers)
    assert value == [2, 4] and note == plain_buffers_note("llama.cpp was killed by SIGSEGV (signal 11)")
    assert llama_stream_logits_in_child("m.gguf", [1, 2], 2, extra_buffers=False,
                                        compute=segfaults_with_extra_buffers) == ([2, 4], None)
    with pytest.raises(RuntimeError, match=r"^llama.cpp computing m.gguf's logits was killed by SIGSEGV \(signal 11\)$"):
        llama_stream_logits_in_child("m.gguf", [1], 2, compute=always_segfaults)
    with pytest.raises(RuntimeError, match=r"^llama.cpp computing m.gguf's logits failed: ValueError: no such model$"):
        llama_stream_logits_in_child("m.gguf", [1], 2, compute=raises_value_error)
    with pytest.raises(RuntimeError, match=r"^llama.cpp computing m.gguf's logits took more than 2 s$"):
        llama_stream_logits_in_child("m.gguf", [1], 2, timeout=2, compute=sleeps)


FAKE_MACHINE = {"cpu": "test cpu", "threads": 2, "platform": "test", "torch": "x", "onnxruntime": "x",
                "moedeploy": "x", "bandwidth_gbs": 10.0, "gemm_gflops": 100.0, "huge_pages": "off (test)"}


def test_peers_left_out_are_reported_and_rounds_interleave(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peers made absent (find_spec answers None); the workers are replaced by their results."""
    from typer.testing import CliRunner

    import moedeploy.bench.api as api
    from moedeploy.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in PEER_MODULES else real(name, *a))
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(api, "describe", lambda threads: FAKE_MACHINE)
    order = []
    # decode tokens/s by backend and round: the machine slows down in round 2, ort more than torch
    rates = {"torch": [50.0, 25.0], "ort": [100.0, 75.0]}

    def worker(settings):
        round_no = order.count(settings.backend)
        order.append(settings.backend)
        result = _result(settings.backend, [rates[settings.backend][round_no]], [5.0], 300.0, [[1, 2, 3]])
        # a round that says how it ran differently (as a llama.cpp worker retried without its extra
        # buffers), and whose bandwidth probe read 19 GB/s where the others read 10
        return result | ({"note": "ran without its extra buffers", "bandwidth_gbs": 19.0}
                         if (settings.backend, round_no) == ("ort", 1) else {})

    monkeypatch.setattr(api, "run_in_subprocess", worker)
    out = tmp_path / "bench.json"
    done = CliRunner().invoke(app, ["bench", "tiny", "--backend", "torch,ort", "--peers", "--rounds", "2",
                                    "--new-tokens", "4", "--prompt-len", "4", "--repeat", "1", "--json", str(out)])
    assert done.exit_code == 0, done.output
    assert order == ["torch", "ort", "ort", "torch"]  # interleaved, and rotated each round
    report = json.loads(out.read_text())
    assert report["peers_skipped"] == {
        "llama.cpp": "backend 'llama.cpp' needs llama_cpp, which is not installed: "
                     "pip install 'moedeploy[peers]' (llama-cpp-python and gguf)",
        "openvino": "backend 'openvino' needs openvino, which is not installed: pip install 'moedeploy[peers]' (openvino)"}
    assert "--peers: llama.cpp left out: backend 'llama.cpp' needs llama_cpp" in done.stderr
    assert "--peers: openvino left out: backend 'openvino' needs openvino" in done.stderr
    assert report["settings"]["rounds"] == 2
    assert report["raw"][0]["decode_tokens_per_s_all"] == [50.0, 25.0]
    assert "min / median / max over 2 runs (2 rounds of 1):" in done.stdout
    assert "ort: ran without its extra buffers" in report["warnings"]
    assert "warning: ort: ran without its extra buffers" in done.stderr
    assert report["raw"][1]["bandwidth_gbs_all"] == [10.0, 19.0]
    probes = "the run's memory-bandwidth probes read 10.0 to 19.0 GB/s (median 10.0, spread 90%"
    assert any(w.startswith(probes) for w in report["warnings"]) and probes in " ".join(done.stderr.split())
    # medians 87.5 / 37.5 = 2.333; by round 100 / 50 = 2 and 75 / 25 = 3, median 2.5
    ratio = report["ratios"]["ort_vs_torch"]
    assert ratio["decode_speedup"] == 2.333
    assert ratio["decode_speedup_paired"] == {"median": 2.5, "by_round": [2.0, 3.0]}
    assert "ort_vs_torch: decode x2.33 (paired by round: x2.50, rounds 2.00 / 3.00)" in " ".join(done.stdout.split())


def test_naming_an_absent_peer_fails_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moedeploy.bench.api as api
    from moedeploy.bench.api import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(api, "describe", lambda *_: pytest.fail("timing started before the backends were checked"))
    with pytest.raises(ValueError, match=r"backend 'llama.cpp' needs llama_cpp, which is not installed: pip install"):
        bench("tiny", ["ort", "llama.cpp"])
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        bench("tiny", ["ort"], rounds=0)
    assert not (tmp_path / "cache").exists()


def greedy_tokens(choose, prompt: torch.Tensor, new: int) -> list[int]:
    """`new` tokens of one row from a bench greedy function (ids, start) -> (1, 1), from an empty cache."""
    tokens, token = [], choose(prompt, 0)
    for i in range(new):
        assert token.shape == (1, 1)
        tokens.append(int(token))
        if i < new - 1:
            token = choose(token, prompt.shape[1] + i)
    return tokens


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (pip install llama-cpp-python)")
def test_llama_cpp_on_the_gguf_computes_the_eager_model(tmp_path: Path) -> None:
    """llama.cpp's own forward pass on our GGUF against our eager decoder: logits and greedy tokens."""
    from moedeploy.bench.gguf import write_gguf
    from moedeploy.bench.peers import llama_cpp_stepper

    config = preset("tiny")
    torch.manual_seed(0)
    model = MoEDecoder(config).eval()
    path = write_gguf(config, ModuleWeights(model), tmp_path / "m.gguf", "0" * 64)
    prompt = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    reset, step, greedy = llama_cpp_stepper(str(path), threads=2, total=40, prompt_len=12)
    reset(1, 40)
    theirs = step(prompt, 0)
    with torch.inference_mode():
        ours = model(prompt, model.new_cache(1, 40), 0)[:, -1]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    expected = model.generate(prompt, max_new_tokens=16)[0, 12:].tolist()
    for choose in (argmax_greedy(step), greedy):  # the logits' argmax, then llama.cpp's own greedy path
        reset(1, 40)
        assert greedy_tokens(choose, prompt, 16) == expected


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (pip install llama-cpp-python)")
def test_llama_cpp_without_extra_buffers_still_computes_the_eager_model(tmp_path: Path) -> None:
    """use_extra_bufts off reaches llama.cpp's model params (and llama-cpp-python's defaults are
    restored after), and the teacher-forced logits of every position, computed in a child, are
    the eager model's."""
    import llama_cpp.llama as high_level

    from moedeploy.bench.gguf import write_gguf
    from moedeploy.bench.peers import llama_model, llama_stream_logits_in_child

    config = preset("tiny")
    torch.manual_seed(0)
    model = MoEDecoder(config).eval()
    path = str(write_gguf(config, ModuleWeights(model), tmp_path / "m.gguf", "0" * 64))
    defaults = high_level.llama_cpp.llama_model_default_params
    assert llama_model(path, True, n_ctx=16, verbose=False).model_params.use_extra_bufts is True
    assert llama_model(path, False, n_ctx=16, verbose=False).model_params.use_extra_bufts is False
    assert high_level.llama_cpp.llama_model_default_params is defaults
    assert llama_model(path, True, n_ctx=16, verbose=False).model_params.use_extra_bufts is True
    ids = torch.randint(0, config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = model(ids, model.new_cache(1, 10), 0)[0].numpy()
    for extra in (True, False):
        logits, note = llama_stream_logits_in_child(path, ids[0].tolist(), threads=2, extra_buffers=extra)
        # every position of one batch through llama.cpp's f16 KV cache: within 1e-3 of logits ~0.3
        np.testing.assert_allclose(logits, ours, rtol=0, atol=1e-3)
        assert note is None  # f32 weights have no AMX or repacked buffers to crash in


@pytest.fixture(scope="module")
def tiny_fp32(tmp_path_factory):
    from tests.export.artifacts import ArtifactStore

    return ArtifactStore.for_session(tmp_path_factory).decoder("fp32")


@pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed (pip install openvino)")
def test_openvino_on_the_artifact_computes_the_eager_model(tiny_fp32) -> None:
    """OpenVINO's CPU plugin on the artifact's graph, its KV cache kept as state, against eager
    PyTorch: last-position logits of a batch of two prompts, and 16 greedy tokens over the cache."""
    from moedeploy.bench.openvino_peer import openvino_stepper
    from tests.export.artifacts import eager_decoder

    model = eager_decoder("fp32")
    config = model.config
    prompts = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    reset, step, greedy = openvino_stepper(tiny_fp32, threads=2)
    reset(2, 40)
    theirs = step(prompts, 0)
    with torch.inference_mode():
        ours = model(prompts, model.new_cache(2, 40), 0)[:, -1]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)

    prompt = prompts[:1]
    expected = model.generate(prompt, max_new_tokens=16)[0, 12:].tolist()
    # a second generation starts from an empty cache again; OpenVINO's own greedy path, then the logits' argmax
    for choose in (greedy, argmax_greedy(step)):
        reset(1, 40)
        assert greedy_tokens(choose, prompt, 16) == expected
    with pytest.raises(RuntimeError, match="cache holds 27 positions, step starts at 3"):
        step(prompt[:, :1], 3)
    # the graph was read from a temporary folder of the artifact's cache, removed once read
    assert not list((tiny_fp32.path / "cache").glob("openvino-*"))


def test_openvino_refuses_what_is_not_the_fp32_comparison() -> None:
    from moedeploy.bench.peers import check_config

    with pytest.raises(ValueError, match=r"backend 'openvino' is the fp32 comparison .* not this quantized artifact's"):
        check_config("openvino", preset("tiny"), batch=1, quantized=True)
    with pytest.raises(ValueError, match="not this fp16 artifact's"):
        check_config("openvino", preset("tiny"), batch=1, dtype="fp16")
    check_config("openvino", preset("tiny"), batch=4)  # any batch: the state is made for the step's
    with pytest.raises(ValueError, match=r"backend 'llama.cpp' is the fp32 comparison .* not this fp16 artifact's"):
        check_config("llama.cpp", preset("tiny"), batch=1, dtype="fp16")  # was: "re-export it", which cannot help


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf is not installed (pip install gguf)")
def test_a_cached_gguf_damaged_in_its_tensor_data_is_written_again(tiny_fp32, tmp_path: Path) -> None:
    """The fingerprint a GGUF records is a header field: a file damaged in its tensors kept it, and
    llama.cpp was timed on other weights. The sha256 sidecar written with the file catches that."""
    import hashlib

    from moedeploy.bench.gguf import recorded_fingerprint
    from moedeploy.bench.peers import gguf_file

    lines: list[str] = []
    path = gguf_file(tiny_fp32, tmp_path, lines.append)
    good = path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]
    assert (tmp_path / (path.name + ".sha256")).read_text().strip() == hashlib.sha256(good).hexdigest()
    written = path.stat().st_mtime_ns
    assert gguf_file(tiny_fp32, tmp_path, lines.append) == path and path.stat().st_mtime_ns == written  # reused

    damaged = bytearray(good)
    damaged[-4096:] = bytes(4096)  # the last tensor's values zeroed; the header is untouched
    assert damaged != good
    path.write_bytes(bytes(damaged))
    assert recorded_fingerprint(path) == tiny_fp32.manifest["config"]["source"]["weights_sha256"]
    lines.clear()
    assert gguf_file(tiny_fp32, tmp_path, lines.append) == path
    assert path.read_bytes() == good
    assert any("does not match the sha256 recorded when it was written" in line for line in lines), lines
    (tmp_path / (path.name + ".sha256")).unlink()  # a file from before the sidecar: written again too
    gguf_file(tiny_fp32, tmp_path, lines.append)
    assert path.read_bytes() == good and (tmp_path / (path.name + ".sha256")).is_file()


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf is not installed (pip install gguf)")
def test_a_moved_checkpoints_gguf_is_written_from_where_it_is_now(tmp_path: Path) -> None:
    """The GGUF was rebuilt from the folder the export was first made from: a checkpoint moved (or
    copied and the original removed) failed with "checkpoint folder ... does not exist" though
    bench was given its new place."""
    from moedeploy.bench.peers import gguf_file
    from moedeploy.export import export
    from tests.models.helpers import tiny_mixtral

    first, moved = tmp_path / "first", tmp_path / "moved"
    tiny_mixtral(seed=3).save_pretrained(first)
    artifact = export("decoder", tmp_path / "artifact", checkpoint=first)
    first.rename(moved)
    with pytest.raises(Exception, match="does not exist"):
        gguf_file(artifact, tmp_path / "cache", lambda _: None)
    path = gguf_file(artifact, tmp_path / "cache", lambda _: None, checkpoint=moved)
    assert path.is_file() and path.with_name(path.name + ".sha256").is_file()


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf is not installed (pip install gguf)")
def test_a_cache_that_cannot_take_the_gguf_is_named_with_the_fix(tiny_fp32, tmp_path: Path, monkeypatch) -> None:
    """The errors named the temporary file the write failed on ('Permission denied: .../.gguf-...tmp',
    'Is a directory: ...tmp'), with no fix. A folder in the file's place is left as it is."""
    import errno

    import moedeploy.bench.gguf as gguf_module
    from moedeploy.bench.peers import gguf_file

    expected = tiny_fp32.manifest["config"]["source"]["weights_sha256"]
    in_the_way = tmp_path / f"gguf-{expected[:16]}-f32.gguf"
    (in_the_way / "mine").mkdir(parents=True)
    with pytest.raises(OSError, match=r"is a folder, where bench keeps its GGUF file; move it away, or set "
                                      r"MOEDEPLOY_CACHE") as e:
        gguf_file(tiny_fp32, tmp_path, lambda _: None)
    assert str(in_the_way) in str(e.value) and ".tmp" not in str(e.value)
    assert (in_the_way / "mine").is_dir() and sorted(p.name for p in tmp_path.iterdir()) == [in_the_way.name]

    def denied(*_args, **_kwargs):  # what a cache folder of another user gives (root writes anywhere here)
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "other" / ".gguf-x.tmp"))

    monkeypatch.setattr(gguf_module, "write_gguf", denied)
    with pytest.raises(OSError, match=rf"cannot write bench's cache {tmp_path / 'other'} \(Permission denied\); "
                                      r"set MOEDEPLOY_CACHE to a folder you can write"):
        gguf_file(tiny_fp32, tmp_path / "other", lambda _: None)
