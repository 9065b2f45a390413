"""`moedeploy bench`: the JSON contract, backend agreement, and the roofline arithmetic.

No timing is asserted: only that the figures exist, are positive, and that backends with
the same weights generate the same greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moedeploy.bench.roofline import decode_step_bytes, decode_step_flops
from moedeploy.models import preset


def test_small_preset_decode_step_bytes_by_hand() -> None:
    c = preset("small")  # hidden 512, 8 layers, 8 heads of 64, 2 KV heads, 8 experts, top-2, expert 1024, vocab 32000
    attention = 512 * 512 * 2 + 512 * 128 * 2  # wq, wo + wk, wv
    experts = 2 * 3 * 512 * 1024  # the two chosen experts' gate, up, down
    per_layer = attention + 512 * 8 + experts + 2 * 512  # + router + two RMSNorm weights
    weights = 8 * per_layer + 512 * 32000 + 512 * 2  # + LM head + final norm + one embedding row
    assert decode_step_bytes(c, batch=1, context=0) == 4 * weights
    kv = 8 * 2 * 2 * 100 * 64  # layers x (k, v) x kv heads x positions x head dim
    assert decode_step_bytes(c, batch=1, context=100) == 4 * (weights + kv)
    assert 185e6 < decode_step_bytes(c) < 190e6  # the "about 187 MB"
    # batch 4 touches min(E, k * 4) = 8 experts
    assert decode_step_bytes(c, batch=4) - decode_step_bytes(c, batch=1) == 4 * (8 * 6 * 3 * 512 * 1024 + 3 * 512)
    assert decode_step_flops(c, batch=2) == 2 * decode_step_flops(c, batch=1)


def test_bench_cli_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "moedeploy.cli", "bench", "tiny", "--backend", "torch,ort", "--prompt-len", "8",
         "--new-tokens", "6", "--repeat", "1", "--json", str(out)],
        capture_output=True, text=True, check=False, env={**os.environ, "MOEDEPLOY_CACHE": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"cpu", "threads", "bandwidth_gbs", "gemm_gflops"} <= set(report["machine"])
    metrics = {(r["backend"], r["metric"]): r for r in report["results"]}
    for backend in ("torch", "ort"):
        for metric, unit in (("prefill_ms", "ms"), ("decode_tokens_per_s", "tokens/s"), ("peak_rss_mb", "MB"),
                             ("token_latency_p50_ms", "ms"), ("token_latency_p99_ms", "ms")):
            row = metrics[(backend, metric)]
            assert row["unit"] == unit and row["value"] > 0
    assert report["greedy_tokens_agree"] is True  # same weights, same greedy tokens
    assert "ort_vs_torch" in report["ratios"]


def test_bench_rejects_a_block_and_an_unknown_backend(tmp_path: Path) -> None:
    from moedeploy.export import export

    block = export("rmsnorm", tmp_path / "rms")
    for args in (["bench", str(block.path)], ["bench", "tiny", "--backend", "tpu"]):
        done = subprocess.run([sys.executable, "-m", "moedeploy.cli", *args], capture_output=True, text=True, check=False)
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
