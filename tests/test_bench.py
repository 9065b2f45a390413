"""`moedeploy bench`: the JSON contract, backend agreement, and the roofline arithmetic.

No timing is asserted: only that the figures exist, are positive, and that backends with
the same weights generate the same greedy tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moedeploy.bench.roofline import decode_step_bytes, decode_step_flops
from moedeploy.models import preset
from tests.export.artifacts import ArtifactStore, rewrite_manifest


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


def test_weight_bytes_of_the_tiny_preset_by_hand() -> None:
    from moedeploy.bench.roofline import weight_bytes

    c = preset("tiny")  # vocab 256, hidden 64, 2 layers, 4 heads / 2 KV heads of 16, 4 experts of 96
    embed_and_head = 2 * 256 * 64
    attention = 64 * 64 + 2 * (64 * 32) + 64 * 64
    layer = attention + 2 * 64 + 4 * 64 + 4 * 3 * 64 * 96  # + norms, router, experts
    assert weight_bytes(c) == 4 * (embed_and_head + 2 * layer + 64)


def test_bench_cli_writes_the_documented_json(tmp_path: Path, tmp_path_factory) -> None:
    """The real command on a cache that already holds the tiny preset: the session's export of it
    (the same `export("decoder", preset_name="tiny")`), copied where bench looks. Exporting into an
    empty cache, and saying so, is test_a_failed_backend_exits_1_and_the_spread_is_shown's part."""
    folder = tmp_path / "cache" / "bench" / "decoder-tiny-fp32-seed0"
    shared = ArtifactStore.for_session(tmp_path_factory).decoder("fp32")
    shutil.copytree(shared.path, folder, ignore=shutil.ignore_patterns("cache", "report", "engines"))
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "moedeploy.cli", "bench", "tiny", "--backend", "torch,ort,ort-gqa", "--prompt-len", "8",
         "--new-tokens", "6", "--repeat", "2", "--json", str(out)],
        capture_output=True, text=True, check=False, env={**os.environ, "MOEDEPLOY_CACHE": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"cpu", "threads", "bandwidth_gbs", "gemm_gflops", "huge_pages"} <= set(report["machine"])
    metrics = {(r["backend"], r["metric"]): r for r in report["results"]}
    for backend in ("torch", "ort", "ort-gqa"):
        for metric, unit in (("prefill_ms", "ms"), ("decode_tokens_per_s", "tokens/s"), ("peak_rss_mb", "MB"),
                             ("token_latency_p50_ms", "ms"), ("token_latency_p99_ms", "ms")):
            row = metrics[(backend, metric)]
            assert row["unit"] == unit and row["value"] > 0
    assert report["greedy_tokens_agree"] is True  # same weights, same greedy tokens (GroupQueryAttention too)
    for raw in report["raw"]:  # the backend's own memory: its peak over the worker's baseline before loading
        assert 50 < raw["baseline_rss_mb"] < raw["peak_rss_mb"]
        assert raw["backend_rss_mb"] == max(raw["peak_rss_mb"], raw["load_peak_rss_mb"]) - raw["baseline_rss_mb"]
        # the bound against the bandwidth this worker measured: tokens/s = bytes/step over GB/s
        bound = 1 / max(report["roofline"]["decode_step_bytes"] / (raw["bandwidth_gbs"] * 1e9),
                        report["roofline"]["decode_step_flops"] / (report["machine"]["gemm_gflops"] * 1e9))
        assert metrics[(raw["backend"], "fraction_of_own_bandwidth_bound")]["value"] == pytest.approx(
            raw["decode_tokens_per_s"] / bound, abs=1e-3)
    assert "ort_vs_torch" in report["ratios"]
    # each ONNX Runtime row says what its session ran: tiny's 2 MoE layers cut in two on 2 threads
    lowering = {raw["backend"]: raw.get("lowering") for raw in report["raw"]}
    assert lowering["torch"] is None
    assert (lowering["ort-gqa"]["moe_split"], lowering["ort-gqa"]["attention_gqa"], lowering["ort"]["moe_split"]) == (2, 2, 2)
    for raw in report["raw"]:  # the spread is min / median / max of every timed run
        for key in ("decode_tokens_per_s", "prefill_ms"):
            runs = raw[f"{key}_all"]
            assert len(runs) == 2
            spread = report["spread"][raw["backend"]][key]
            assert spread["min"] == min(runs) and spread["max"] == max(runs)
            assert spread["median"] == pytest.approx((runs[0] + runs[1]) / 2, rel=1e-12)
            assert spread["median"] == raw[key]  # the table's figure
    assert "min / median / max over 2 runs:" in done.stdout
    # read, not exported again (a copy that failed to load would have been re-exported: written True)
    assert f"was read from the cache {folder}" in done.stderr
    # the cache's size is measured after the run; the ort backend added no second copy of the
    # weights (its lowered graph reads model.onnx.data where it is)
    assert not (folder / "cache").exists()
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)
    assert report["cache"] == {"path": str(folder), "bytes": size, "written": False}


def test_bench_rejects_a_block_and_an_unknown_backend(tmp_path_factory) -> None:
    block = ArtifactStore.for_session(tmp_path_factory).block("rmsnorm")  # only read: refused before any work
    for args in (["bench", str(block.path)], ["bench", "tiny", "--backend", "tpu"]):
        done = subprocess.run([sys.executable, "-m", "moedeploy.cli", *args], capture_output=True, text=True, check=False)
        assert done.returncode == 1
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr


# --- up-front checks: a backend that cannot run fails in one line, before any export or timing

BLOCK_TRANSFORMERS = "import sys\nsys.modules['transformers'] = None  # import fails, find_spec answers None\n"


def test_hf_without_transformers_fails_first_with_the_install_command(tmp_path: Path) -> None:
    """A real interpreter where `import transformers` fails (sitecustomize), running the real command."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_TRANSFORMERS)
    cache = tmp_path / "cache"
    env = {**os.environ, "MOEDEPLOY_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run([sys.executable, "-c", "import transformers"], env=env, capture_output=True, text=True, check=False)
    assert probe.returncode != 0 and "transformers" in probe.stderr  # the block works
    done = subprocess.run([sys.executable, "-m", "moedeploy.cli", "bench", "tiny", "--backend", "torch,hf"],
                          capture_output=True, text=True, check=False, env=env, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: backend 'hf' needs Hugging Face transformers")
    assert "pip install 'transformers" in lines[0]
    assert not cache.exists()  # nothing exported


def _forbid_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    import moedeploy.bench.api as api

    def fail(*_: object, **__: object) -> None:
        raise AssertionError("timing started before the backends were checked")

    monkeypatch.setattr(api, "describe", fail)
    monkeypatch.setattr(api, "run_in_subprocess", fail)


def test_missing_transformers_is_found_by_find_spec_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moedeploy.bench.api import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    _forbid_timing(monkeypatch)
    with pytest.raises(ValueError, match=r"backend 'hf' needs Hugging Face transformers.*pip install"):
        bench("tiny", ["torch", "hf"])
    assert not (tmp_path / "cache").exists()


def test_torch_compile_without_a_cxx_compiler_fails_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own compiler setting points at a compiler that does not exist."""
    from torch._inductor import config

    from moedeploy.bench.api import bench

    monkeypatch.setattr(config.cpp, "cxx", (None, str(tmp_path / "no-such-g++")))
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    _forbid_timing(monkeypatch)
    with pytest.raises(ValueError, match=r"backend 'torch-compile' needs a C\+\+ compiler.*set CXX"):
        bench("tiny", ["torch-compile"])
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_trt_without_tensorrt_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moedeploy.bench.api import bench
    from moedeploy.runtime.tensorrt import TensorRTUnavailable

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    _forbid_timing(monkeypatch)
    with pytest.raises(TensorRTUnavailable, match=r"backend 'trt': TensorRT is not installed.*pip install 'moedeploy\[gpu\]'"):
        bench("tiny", ["ort", "trt"])
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("backends", "message"), [
    ([], "--backend needs at least one of"),
    (["ort", "tpu"], "unknown backend 'tpu'"),
    (["ort", "ort"], "backend 'ort' is listed twice"),
])
def test_backend_lists_are_checked_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   backends: list[str], message: str) -> None:
    from moedeploy.bench.api import bench

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    _forbid_timing(monkeypatch)
    with pytest.raises(ValueError, match=message):
        bench("tiny", backends)
    assert not (tmp_path / "cache").exists()


def test_too_many_positions_fail_before_the_preset_is_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moedeploy.bench.api import bench

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    _forbid_timing(monkeypatch)
    positions = preset("tiny").max_positions
    with pytest.raises(ValueError, match=rf"\({positions - 1} \+ 2\) exceeds the model's {positions} positions; "
                                         rf"ask for at most {positions} in all"):
        bench("tiny", ["ort"], prompt_len=positions - 1, new_tokens=2)
    with pytest.raises(ValueError, match=r"--new-tokens must be >= 2 \(the first new token is the prefill's"):
        bench("tiny", ["ort"], new_tokens=1)
    assert not (tmp_path / "cache").exists()


def test_a_presets_cache_folder_holding_another_export_is_not_timed_as_the_preset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path_factory) -> None:
    """Any sealed decoder copied into decoder-tiny-fp32-seed0 loaded, and bench timed it as the
    fp32 'tiny' preset (an fp16 export, a quantized one, another seed). The preset's own export
    is used; another one is named and exported again."""
    from moedeploy.bench.api import existing_artifact, preset_folder

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    store = ArtifactStore.for_session(tmp_path_factory)
    folder = preset_folder("tiny")
    folder.parent.mkdir(parents=True)
    shutil.copytree(store.decoder("fp32").path, folder)  # the tiny preset at seed 0, in fp32: what bench exports
    assert existing_artifact("tiny").path == folder
    shutil.rmtree(folder)
    shutil.copytree(store.decoder("fp16").path, folder)
    lines: list[str] = []
    assert existing_artifact("tiny", lines.append) is None
    assert lines == [f"the cached export {folder} cannot be used (it holds an fp16 'decoder', not the fp32 "
                     "decoder): exporting again"]
    assert existing_artifact("small", lines.append) is None  # nothing cached for it: nothing to say
    assert len(lines) == 1


def test_a_block_size_the_model_cannot_take_fails_before_the_float_export(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """It failed only after the fp32 export that --quantize starts from (13 s for tiny; for a real
    checkpoint, the export of tens of GB). The tiny preset's projections read 64 inputs."""
    from moedeploy.bench.api import bench

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    _forbid_timing(monkeypatch)
    assert preset("tiny").hidden_size == 64
    with pytest.raises(ValueError, match=r"input dimension 64 is not a multiple of --block-size 128; choose 16 or 32"):
        bench("tiny", ["ort"], quantize=["int8"], block_size=128)
    assert not (tmp_path / "cache").exists()


# --- the cache: where (XDG), how much, how to remove it

def test_cache_folder_follows_moedeploy_cache_then_xdg_then_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moedeploy.bench.api import cache_dir

    monkeypatch.delenv("MOEDEPLOY_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "moedeploy"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: ignore a relative path
    assert cache_dir() == Path.home() / ".cache" / "moedeploy"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "moedeploy"
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_readme_outputs_are_ignored_by_git() -> None:
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("bench.json", "repo/", "repo/decoder/config.pbtxt"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=root, check=False)
        assert done.returncode == 0, f"{path} is not ignored"
    assert subprocess.run(["git", "check-ignore", "-q", "src/moedeploy/bench/api.py"], cwd=root, check=False).returncode == 1


# --- spread over --repeat runs, and the busy-machine warning, on hand-computed numbers

def test_spread_is_min_median_max_and_max_minus_min_over_median() -> None:
    from moedeploy.bench.spread import Spread

    s = Spread.of([110.0, 90.0, 100.0])
    assert (s.low, s.median, s.high) == (90.0, 100.0, 110.0)
    assert s.relative == pytest.approx(20.0 / 100.0)
    assert Spread.of([4.0, 1.0, 2.0, 3.0]).median == 2.5  # even count: the mean of the middle two
    assert Spread.of([7.0]).relative == 0.0


def test_busy_warning_above_ten_percent_only() -> None:
    from moedeploy.bench.spread import Spread, busy_warning

    quiet = {"decode_tokens_per_s": Spread.of([100.0, 95.0, 104.0]), "prefill_ms": Spread.of([50.0, 51.0, 52.0])}
    assert busy_warning("ort", quiet, 3) is None  # 9% and 4%
    edge = {"decode_tokens_per_s": Spread.of([95.0, 100.0, 105.0]), "prefill_ms": Spread.of([50.0, 50.0, 50.0])}
    assert busy_warning("ort", edge, 3) is None  # exactly 10% is not above it
    busy = {"decode_tokens_per_s": Spread.of([90.0, 100.0, 110.0]), "prefill_ms": Spread.of([42.0, 50.0, 48.0])}
    warning = busy_warning("ort", busy, 3)
    assert warning is not None
    assert warning.startswith("ort: runs spread decode tokens/s 20%, prefill ms 17%")  # 20 / 100, 8 / 48
    assert "(max - min) / median over 3 runs, above 10%" in warning and "busy" in warning


def test_bandwidth_probes_that_disagree_say_of_bound_is_not_to_be_read_alone() -> None:
    """Probes as one session's rows had them (31.9 and 59.1 GB/s in one run) beside a machine
    probe of 31.2 and another row's 32.2: spread (59.1 - 31.2) / median 32.05 = 87%. Within 20%
    of the median nothing is said. Paired ratios need rounds: with one, the advice says so."""
    from moedeploy.bench.spread import probes_warning

    warning = probes_warning([31.2, 32.2, 31.9, 59.1], 3)
    assert warning is not None
    assert warning.startswith("the run's memory-bandwidth probes read 31.2 to 59.1 GB/s (median 32.0, spread 87%")
    assert "; compare backends by their paired decode ratio, or rerun when the machine is idle" in warning
    one_round = probes_warning([31.2, 32.2, 31.9, 59.1], 1)
    assert one_round is not None and "rerun with --rounds 3 and compare backends by their paired decode ratio" in one_round
    assert probes_warning([30.0, 33.0, 36.0], 3) is None  # 6 / 33 = 18%
    assert probes_warning([30.0, 37.0, 33.0], 3) is not None  # 7 / 33 = 21%
    assert probes_warning([59.1], 3) is None  # one probe: nothing to compare


def test_every_rounds_probe_is_kept_and_the_median_is_the_rows() -> None:
    from moedeploy.bench.api import merge_rounds

    rounds = [{"backend": "ort", "prefill_ms": 1.0, "prefill_ms_all": [1.0], "decode_tokens_per_s": 1.0,
               "decode_tokens_per_s_all": [1.0], "token_latency_p50_ms": 1.0, "token_latency_p99_ms": 1.0,
               "load_s": 1.0, "peak_rss_mb": 1.0, "load_peak_rss_mb": 1.0, "backend_rss_mb": 1.0,
               "baseline_rss_mb": 1.0, "bandwidth_gbs": gbs, "tokens": [[1]]} for gbs in (31.0, 52.6, 55.0)]
    merged = merge_rounds(rounds)
    assert merged["bandwidth_gbs_all"] == [31.0, 52.6, 55.0] and merged["bandwidth_gbs"] == 52.6
    assert merge_rounds(rounds[:1])["bandwidth_gbs_all"] == [31.0]  # one round: a list of one


def test_last_level_cache_is_the_largest_level_in_sysfs(tmp_path: Path) -> None:
    from moedeploy.bench.machine import last_level_cache_bytes

    for index, level, size in (("index0", "1", "48K"), ("index1", "1", "32K"), ("index2", "2", "2048K"),
                               ("index3", "3", "266240K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(level + "\n")
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 266240 * 1024  # 260 MiB, the L3
    (tmp_path / "index3" / "size").write_text("garbled\n")
    assert last_level_cache_bytes(tmp_path) == 2048 * 1024  # an unreadable level is left out
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_the_cache_line_names_the_quantized_exports_bench_wrote_beside_the_float_one() -> None:
    """After --quantize, the line named only the fp32 folder: its int8 and int4 exports (tens of
    MB each) were left in the cache unmentioned."""
    from moedeploy.bench.summary import cache_line

    report = {"settings": {"target": "tiny"}, "cache": {
        "path": "/c/bench/decoder-tiny-fp32-seed0", "bytes": 2_000_000, "written": True,
        "quantized": [{"path": "/c/bench/decoder-tiny-fp32-seed0-int8b32", "bytes": 700_000},
                      {"path": "/c/bench/decoder-tiny-fp32-seed0-int4b32", "bytes": 500_000}]}}
    assert cache_line(report) == (
        "the 'tiny' decoder was exported into the cache /c/bench/decoder-tiny-fp32-seed0 (2.0 MB), its quantized "
        "exports beside it (1.2 MB); remove them with `rm -r /c/bench/decoder-tiny-fp32-seed0 "
        "/c/bench/decoder-tiny-fp32-seed0-int8b32 /c/bench/decoder-tiny-fp32-seed0-int4b32`, or set MOEDEPLOY_CACHE "
        "to keep it elsewhere")
    del report["cache"]["quantized"]
    assert "remove it with `rm -r /c/bench/decoder-tiny-fp32-seed0`," in cache_line(report)


def test_cache_warning_only_when_the_cache_holds_a_quarter_of_a_step() -> None:
    from moedeploy.bench.api import cache_holds_step_warning

    assert cache_holds_step_warning(None, 189e6) is None
    assert cache_holds_step_warning(8, 189e6) is None  # 8 MiB of 189 MB: 4%
    assert cache_holds_step_warning(45, 189e6) is None  # 47.2 MB: 24.96%, under a quarter
    half = cache_holds_step_warning(90, 189e6)  # 94.4 MB: 50%
    assert half is not None and "(90 MB) holds 50% of a decode step's 189.0 MB" in half and "over 100%" in half
    assert "holds 100% of" in cache_holds_step_warning(260, 189e6)  # more than the step: all of it
    assert "of a decode step's 1.54 GB;" in cache_holds_step_warning(512, 1.54e9)  # not 1.54e+03 MB
    assert "of a decode step's 0.5 MB;" in cache_holds_step_warning(48, 0.5e6)  # not 0 MB


# --- what the command prints and its exit code, around one measured backend and one that failed

FAKE_MACHINE = {"cpu": "test cpu", "cores": 2, "threads": 2, "python": "3", "torch": "x", "onnxruntime": "x",
                "moedeploy": "x", "bandwidth_gbs": 10.0, "gemm_gflops": 100.0, "huge_pages": "off (test)"}


def _torch_result() -> dict:
    return {"backend": "torch", "prefill_ms": 48.0, "prefill_ms_all": [42.0, 50.0, 48.0],
            "decode_tokens_per_s": 100.0, "decode_tokens_per_s_all": [90.0, 110.0, 100.0],
            "token_latency_p50_ms": 10.0, "token_latency_p99_ms": 12.0, "peak_rss_mb": 300.0,
            "load_peak_rss_mb": 250.0, "load_s": 0.5, "baseline_rss_mb": 200.0, "backend_rss_mb": 100.0, "bandwidth_gbs": 10.0, "tokens": [[1, 2, 3]]}


def test_a_failed_backend_exits_1_and_the_spread_is_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers are replaced by their results (one measured, one failed); everything after is the real command."""
    from typer.testing import CliRunner

    import moedeploy.bench.api as api
    from moedeploy.cli import app

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(api, "describe", lambda threads: FAKE_MACHINE)
    results = {"torch": _torch_result(), "ort": {"backend": "ort", "error": "ONNX Runtime fell over"}}
    monkeypatch.setattr(api, "run_in_subprocess", lambda settings: results[settings.backend])
    out = tmp_path / "bench.json"
    done = CliRunner().invoke(app, ["bench", "tiny", "--backend", "torch,ort", "--repeat", "3", "--new-tokens", "4",
                                    "--prompt-len", "4", "--json", str(out)])
    assert done.exit_code == 1, done.output
    assert "min / median / max over 3 runs:" in done.stdout
    assert "torch: decode 90.0 / 100.0 / 110.0 tokens/s, prefill 42.0 / 48.0 / 50.0 ms" in done.stdout
    assert "warning: torch: runs spread decode tokens/s 20%, prefill ms 17%" in done.stderr
    assert "error: ort: ONNX Runtime fell over" in done.stderr
    # the cache: where, how much (an independent walk of the folder), how to remove it
    folder = tmp_path / "cache" / "bench" / "decoder-tiny-fp32-seed0"
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)
    assert size > 0
    assert 1e6 < size < 1e9  # the tiny preset: megabytes
    assert f"was exported into the cache {folder} ({size / 1e6:.1f} MB); remove it with `rm -r {folder}`" in done.stderr
    report = json.loads(out.read_text())  # written even though a backend failed
    assert report["spread"]["torch"]["decode_tokens_per_s"] == {"min": 90.0, "median": 100.0, "max": 110.0, "relative": 0.2}
    assert report["cache"] == {"path": str(folder), "bytes": size, "written": True}
    # a second run reads the cache instead of exporting again
    again = CliRunner().invoke(app, ["bench", "tiny", "--backend", "torch", "--repeat", "3", "--new-tokens", "4",
                                     "--prompt-len", "4"])
    assert again.exit_code == 0, again.output
    assert f"was read from the cache {folder}" in again.stderr


# --- a checkpoint folder as the target: exported once into the cache, reused only while it still matches

def _tiny_qwen3(folder: Path, seed: int, dtype: str = "float32") -> Path:
    """transformers' own Qwen3-MoE (random weights, one layer), saved with save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
                            initializer_range=0.5,  # logits far apart: greedy tokens do not hinge on rounding
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


def _fp32_fingerprint(checkpoint: Path) -> str:
    """What the exporter records as the manifest's config.source.weights_sha256 for an fp32 export."""
    import torch

    from moedeploy.models.checkpoint import CheckpointWeights
    from moedeploy.models.weights import fingerprint

    return fingerprint(CheckpointWeights(checkpoint), torch.float32)


def _bench_checkpoint(checkpoint: Path, *extra: str):
    from typer.testing import CliRunner

    from moedeploy.cli import app

    return CliRunner().invoke(app, ["bench", str(checkpoint), "--backend", "torch,ort", "--prompt-len", "4",
                                    "--new-tokens", "3", "--repeat", "1", "--threads", "1", *extra])


def test_a_checkpoint_is_exported_once_reused_while_it_matches_and_exported_again_when_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real command in-process; the workers run `moedeploy.bench.decode.run` in this process
    (the first time) or are replaced by a result (after), and the machine is not measured."""
    import dataclasses

    import torch

    import moedeploy.bench.api as api
    from moedeploy.bench.decode import run
    from moedeploy.export import Artifact

    cache = tmp_path / "cache"
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(cache))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(api, "describe", lambda threads: FAKE_MACHINE)
    threads = torch.get_num_threads()
    monkeypatch.setattr(api, "run_in_subprocess", run)
    checkpoint = _tiny_qwen3(tmp_path / "qwen3", seed=0)
    fp = _fp32_fingerprint(checkpoint)
    first = cache / "bench" / f"checkpoint-{fp[:16]}-fp32"

    # 1. an empty cache: exported, then timed on eager torch (from the checkpoint) and ORT (the export)
    out = tmp_path / "bench.json"
    try:
        done = _bench_checkpoint(checkpoint, "--json", str(out))
    finally:
        torch.set_num_threads(threads)  # the in-process worker set it
    assert done.exit_code == 0, done.output
    report = json.loads(out.read_text())
    assert report["cache"]["path"] == str(first) and report["cache"]["written"] is True
    assert f"was exported into the cache {first}" in done.stderr
    assert Artifact.load(first).manifest["config"]["source"]["weights_sha256"] == fp
    assert report["greedy_tokens_agree"] is True  # eager torch read the checkpoint the ORT graph was exported from
    assert {r["backend"] for r in report["raw"]} == {"torch", "ort"}

    # 2. the same checkpoint again: fingerprinted, found in the cache, not exported
    monkeypatch.setattr(api, "run_in_subprocess", lambda settings: {**_torch_result(), "backend": settings.backend})

    def no_export(*_: object, **__: object) -> None:
        raise AssertionError("exported again")

    real_export = api.export
    monkeypatch.setattr(api, "export", no_export)
    again = _bench_checkpoint(checkpoint, "--json", str(out))
    assert again.exit_code == 0, again.output
    assert json.loads(out.read_text())["cache"] == {"path": str(first), "bytes": api.folder_bytes(first), "written": False}
    assert f"was read from the cache {first}" in again.stderr

    # 3. other random weights (bf16 now) under the same folder, and a cache that claims their name but
    #    holds the old export: not trusted, exported again over it
    shutil.rmtree(checkpoint)
    _tiny_qwen3(checkpoint, seed=1, dtype="bfloat16")
    fp_new = _fp32_fingerprint(checkpoint)
    second = cache / "bench" / f"checkpoint-{fp_new[:16]}-fp32"
    assert fp_new != fp
    shutil.copytree(first, second)
    monkeypatch.setattr(api, "export", real_export)
    changed = _bench_checkpoint(checkpoint, "--json", str(out))
    assert changed.exit_code == 0, changed.output
    assert "cannot be used (its weights fingerprint differs from the checkpoint's): exporting again" in changed.stderr
    assert json.loads(out.read_text())["cache"]["written"] is True
    assert Artifact.load(second).manifest["config"]["source"]["weights_sha256"] == fp_new
    assert Artifact.load(first).manifest["config"]["source"]["weights_sha256"] == fp  # the old one is left alone

    # 4. and reused from then on: the bf16 checkpoint is compared by its fp32 fingerprint, as exported
    monkeypatch.setattr(api, "export", no_export)
    reused = _bench_checkpoint(checkpoint)
    assert reused.exit_code == 0, reused.output
    assert f"was read from the cache {second}" in reused.stderr

    # a cache with the right weights but another config, or a damaged file, is not trusted either
    config = api.CheckpointWeights(checkpoint).config
    assert api.trusted_cache(second, fp_new, config)[0] is not None
    artifact, why = api.trusted_cache(second, fp_new, dataclasses.replace(config, norm_eps=1e-3))
    assert artifact is None and why == "its config differs from the checkpoint's config.json"
    with open(second / "model.onnx.data", "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    artifact, why = api.trusted_cache(second, fp_new, config)
    assert artifact is None and why.startswith("it does not load:")


def test_bad_checkpoint_targets_fail_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from moedeploy.cli import app

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "400")
    _forbid_timing(monkeypatch)
    empty = tmp_path / "empty"
    empty.mkdir()
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    for target, message in (
        (empty, f"{empty} is neither a decoder artifact (no manifest.json) nor a checkpoint folder (no config.json)"),
        (tmp_path / "missing", "is neither an artifact folder, a checkpoint folder nor a preset"),
        (llama, "model_type 'llama' is not supported; supported: mixtral, qwen2_moe, qwen3_moe"),
        (no_weights, "invalid config: missing field"),
    ):
        done = CliRunner().invoke(app, ["bench", str(target), "--backend", "torch,ort"])
        assert done.exit_code == 1, done.output
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], done.stderr
    assert not (tmp_path / "cache").exists()


def test_quantized_decode_step_bytes_of_the_tiny_preset_by_hand() -> None:
    """A quantized artifact's step reads each quantized weight as its code plus its share of a
    32-weight block's scale (4 bytes) and zero point (a code wide): 1 + 5/32 bytes at int8,
    1/2 + 4.5/32 at int4. tiny: hidden 64, 4 heads of 16 (2 KV heads), 4 experts of 96, top-2, vocab 256."""
    c = preset("tiny")
    q_o, k_v = 2 * 64 * 64, 2 * 32 * 64  # wq, wo; wk, wv
    experts = 2 * 3 * 96 * 64  # the two chosen experts' gate, up, down
    head = 256 * 64
    fp32 = decode_step_bytes(c, batch=1, context=0)
    int8, int4 = 1 + 5 / 32, 0.5 + 4.5 / 32

    def tensors(layer_bits: dict[str, int], head_bits: int) -> dict:
        names = {f"layers.{i}.{n}": b for i in range(2) for n, b in layer_bits.items()}
        return {"block_size": 32, "tensors": names | {"lm_head.weight": head_bits}}

    every8 = tensors(dict.fromkeys(["attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight",
                                    "ffn.w_gate", "ffn.w_up", "ffn.w_down"], 8), 8)
    quantized = 2 * (q_o + k_v + experts) + head
    assert decode_step_bytes(c, quantization=every8) == round(fp32 - quantized * (4 - int8))
    mixed4 = tensors({"attn.wq.weight": 4, "attn.wk.weight": 8, "attn.wv.weight": 8, "attn.wo.weight": 4,
                      "ffn.w_gate": 4, "ffn.w_up": 4, "ffn.w_down": 4}, 8)
    at8, at4 = 2 * k_v + head, 2 * (q_o + experts)
    assert decode_step_bytes(c, quantization=mixed4) == round(fp32 - at8 * (4 - int8) - at4 * (4 - int4))
    # format 2, symmetric: signed codes and no zero points, 1 + 4/32 and 1/2 + 4/32 bytes a weight
    signed8, signed4 = 1 + 4 / 32, 0.5 + 4 / 32
    signed = mixed4 | {"format": 2, "symmetric": True}
    assert decode_step_bytes(c, quantization=signed) == round(fp32 - at8 * (4 - signed8) - at4 * (4 - signed4))
    assert decode_step_bytes(c, quantization=signed | {"symmetric": False}) == decode_step_bytes(c, quantization=mixed4)
    # an LM head in blocks of its own (manifest "block_sizes"): 1 + 4/64 bytes a weight in blocks of 64
    head64 = signed | {"block_sizes": {"lm_head.weight": 64}}
    assert decode_step_bytes(c, quantization=head64) == round(
        fp32 - 2 * k_v * (4 - signed8) - head * (4 - (1 + 4 / 64)) - at4 * (4 - signed4))


def test_bench_quantize_times_each_export_beside_its_own_roofline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path_factory) -> None:
    from moedeploy.bench.api import bench
    from moedeploy.export.artifact import MODEL_DATA_FILE
    from tests.onnx_helpers import external_initializer_bytes

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    # the float export in the cache already: the session's (test_bench_cli_writes_the_documented_json's way)
    shared = ArtifactStore.for_session(tmp_path_factory).decoder("fp32")
    shutil.copytree(shared.path, tmp_path / "cache" / "bench" / "decoder-tiny-fp32-seed0",
                    ignore=shutil.ignore_patterns("cache", "report", "engines"))
    report = bench("tiny", ["ort"], prompt_len=8, new_tokens=4, repeat=1, quantize=["int8", "int4"])
    assert report["cache"]["written"] is False  # the float export was read, and the quantized ones made from it
    assert [r["backend"] for r in report["raw"]] == ["ort", "ort int8", "ort int4"]
    assert not [r for r in report["raw"] if "error" in r] and report["greedy_tokens_agree"]
    assert set(report["quantized_tokens_agree"]) == {"int8", "int4"}
    variants = report["variants"]
    assert list(variants) == ["fp32", "int8", "int4"]
    assert variants["fp32"]["decode_step_bytes"] == report["roofline"]["decode_step_bytes"]
    for name in ("int8", "int4"):
        v = variants[name]
        # the weights' own bytes (every initializer loaded, counted in NumPy), not the data file's
        # size, whose alignment gaps are most of a tiny model's file
        stored = external_initializer_bytes(Path(v["artifact"]) / "model.onnx")
        assert v["weight_bytes"] == stored < (Path(v["artifact"]) / MODEL_DATA_FILE).stat().st_size
        assert v["decode_step_bytes"] < variants["fp32"]["decode_step_bytes"]
        # the bound: a step's bytes at the measured bandwidth, or its flops at the measured GEMM
        # rate, whichever takes longer (a busy machine's GEMM rate can cap tiny's int4 bound)
        machine, flops = report["machine"], report["roofline"]["decode_step_flops"]
        step_s = max(v["decode_step_bytes"] / (machine["bandwidth_gbs"] * 1e9), flops / (machine["gemm_gflops"] * 1e9))
        assert v["decode_bound_tokens_per_s"] == pytest.approx(1 / step_s, rel=1e-3, abs=0.05)
        assert v["decode_bound_tokens_per_s"] >= variants["fp32"]["decode_bound_tokens_per_s"]
    assert variants["int4"]["decode_step_bytes"] < variants["int8"]["decode_step_bytes"]
    assert set(report["ratios"]) >= {"ort int8_vs_ort", "ort int4_vs_ort"}
    raw = {r["backend"]: r for r in report["raw"]}
    assert raw["ort int8"]["decode_bound_tokens_per_s"] > raw["ort"]["decode_bound_tokens_per_s"]
    # the cached export is read again while its scheme and weights match, exported again when not
    from moedeploy.bench.api import quantized_variant
    from moedeploy.export import Artifact
    from moedeploy.models.blockquant import QuantScheme

    fp32 = Artifact.load(report["settings"]["artifact"])
    said: list[str] = []
    again = quantized_variant(fp32, QuantScheme(8), "tiny", said.append)
    assert str(again.path) == variants["int8"]["artifact"] and said[0].startswith("reading the cached int8 export")
    # an export whose LM head has other blocks than this moedeploy writes (one from before
    # --head-block-size: blocks of 32) is not reused
    manifest_path = again.path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["quantization"]["block_sizes"] == {"lm_head.weight": 64}  # tiny's hidden 64: whole rows
    del manifest["quantization"]["block_sizes"]
    rewrite_manifest(again.path, manifest)
    said.clear()
    quantized_variant(fp32, QuantScheme(8), "tiny", said.append)
    assert said[0].startswith("exporting tiny as int8"), said


def test_bench_quantize_refusals_are_one_line_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from moedeploy.cli import app

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    runner = CliRunner()
    for args, message in ((["--quantize", "int3"], "choose int8 or int4"),
                          (["--quantize", "int8", "--backend", "torch"], "add one of ort, ort-gqa, ort-gqa-experts, ort-contrib"),
                          (["--quantize", "int8", "--block-size", "24"], "must be a power of two"),
                          (["--block-size", "64"], "--block-size applies with --quantize int8|int4 only"),
                          (["--quantize", ","], "--quantize names int8, int4 or both, comma-separated")):
        result = runner.invoke(app, ["bench", "tiny", *args])
        assert result.exit_code != 0 and message in " ".join(result.output.split()), result.output
        assert "Traceback" not in result.output
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "manifest.json").write_text("{}")
    result = runner.invoke(app, ["bench", str(tmp_path / "art"), "--quantize", "int8", "--backend", "ort"])
    assert result.exit_code != 0 and "is an artifact folder" in " ".join(result.output.split()), result.output
    assert not (tmp_path / "cache").exists()  # nothing exported


def test_bench_quantize_never_replaces_a_folder_it_did_not_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from moedeploy.bench.api import preset_folder
    from moedeploy.cli import app

    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    mine = preset_folder("tiny").with_name(preset_folder("tiny").name + "-int8b32")
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("the user's")
    result = CliRunner().invoke(app, ["bench", "tiny", "--backend", "ort", "--quantize", "int8", "--repeat", "1",
                                      "--prompt-len", "4", "--new-tokens", "2"])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert "holds something moedeploy did not write: move it, or set MOEDEPLOY_CACHE" in " ".join(result.output.split())
    assert (mine / "notes.txt").read_text() == "the user's"


# --- the scripts under benchmarks/: their arguments and --json, as bench's


def test_a_scripts_json_replaces_only_its_own_report(tmp_path: Path) -> None:
    from moedeploy.bench.report_file import SCRIPT_KEY, report_target_problem, write_script_report

    def ours(report: dict) -> bool:
        return report.get(SCRIPT_KEY) == "quantized"

    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    assert "already exists and is not a report quantized wrote" in report_target_problem(notes, ours, "quantized")
    artifact = tmp_path / "art"
    artifact.mkdir()
    (artifact / "manifest.json").write_text("{}")
    assert "is inside the artifact" in report_target_problem(artifact / "manifest.json", ours, "quantized")
    report = tmp_path / "q.json"
    assert report_target_problem(report, ours, "quantized") == ""
    write_script_report(report, "quantized", {"rows": [1]})
    assert json.loads(report.read_text()) == {"benchmark": "quantized", "rows": [1]}
    assert report_target_problem(report, ours, "quantized") == ""  # its own report: a rerun replaces it
    assert "is not a report decode_profile wrote" in report_target_problem(
        report, lambda r: r.get(SCRIPT_KEY) == "decode_profile", "decode_profile")


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize(("script", "args", "message"), [
    ("context_scaling.py", ["{art}", "--json", "{art}/manifest.json"], "is inside the artifact"),
    ("context_scaling.py", ["{art}", "--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("context_scaling.py", ["{art}", "--contexts", "16", "300"],
     "the longest of --contexts + --new-tokens (300 + 64) exceeds"),
    ("context_scaling.py", ["tiny", "--contexts", "300"], "the longest of --contexts + --new-tokens (300 + 64) exceeds"),
    ("quantized.py", ["{art}", "--rounds", "-1"], "--rounds must be at least 1, got -1"),
    ("quantized.py", ["tiny"], "--stream 512 exceeds the model's 256 positions"),
    ("decode_profile.py", ["{art}", "--steps", "-1"], "--steps must be at least 1, got -1"),
    ("decode_profile.py", ["tiny", "--context", "250"], "--context + --steps (250 + 48) exceeds"),
    ("decode_ablation.py", ["{art}", "--json", "{art}/golden/x.json"], "is inside the artifact"),
    ("greedy_token.py", ["{art}", "--new-tokens", "0"], "--new-tokens must be at least 2, got 0"),
    ("greedy_token.py", ["{art}", "--prompt-len", "250"], "--prompt-len + --new-tokens (250 + 64) exceeds"),
    ("greedy_token.py", ["tiny", "--prompt-len", "250"], "--prompt-len + --new-tokens (250 + 64) exceeds"),
    ("trace_layers.py", ["--layers", "8", "1"], "--layers must be at least 2, got [8, 1]"),
    ("trace_layers.py", ["--dtype", "fp8"], "invalid dtype 'fp8'"),
    ("trace_layers.py", ["--json", "{art}/manifest.json"], "manifest.json"),
])
def test_benchmark_scripts_refuse_bad_arguments_in_one_line_before_any_work(script, args, message, tmp_path_factory,
                                                                          tmp_path: Path, monkeypatch, capsys) -> None:
    """They ran past the model's positions (context_scaling: exit 0), overwrote any file with
    --json (an artifact's manifest.json included), and ended bad counts in IndexError or
    ZeroDivisionError tracebacks.

    Run in this process as `python script.py ...` runs it (runpy, as __main__, the script's folder
    first on sys.path): a subprocess spent 3-5 s of each case importing torch. Any exception but
    SystemExit fails the test, as a traceback would; SystemExit's text is what Python prints."""
    import runpy

    artifact = ArtifactStore.for_session(tmp_path_factory).decoder("fp32")
    manifest = (artifact.path / "manifest.json").read_bytes()
    argv = [a.format(art=artifact.path) for a in args]  # a preset is checked before it is exported
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *argv])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    siblings = {p.stem for p in BENCHMARKS.glob("*.py")} - set(sys.modules)  # modules the scripts import
    try:
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    finally:  # what the script imported from its folder (decode_profile) leaves with it
        for name in siblings:
            sys.modules.pop(name, None)
    code, stderr = exit_.value.code, capsys.readouterr().err
    if isinstance(code, str):  # sys.exit("error: ...") prints the text and exits 1
        code, stderr = 1, stderr + code + "\n"
    assert code in (1, 2), stderr
    last = stderr.strip().splitlines()[-1]  # argparse's usage may come before its one error line
    assert "error: " in last and message in last, stderr
    assert (artifact.path / "manifest.json").read_bytes() == manifest and not (tmp_path / "cache").exists()


def test_decode_ablation_row_selection_leaves_the_logits_unchanged(tmp_path_factory, monkeypatch) -> None:
    """-row-selection runs each taken expert on every token, times its routing weight (0 off its
    own tokens), so the edited graph must give the lowered graph's logits: bit for bit at one
    token, and to float rounding over a prompt (more rows through each Gemm). The branches it
    edits must have lost their NonZero, row Gathers and ScatterND, or the variant times nothing."""
    import importlib

    import numpy as np
    import onnx
    import onnxruntime as ort

    from moedeploy.models.config import DecoderConfig
    from moedeploy.runtime.ort import lowered_model, reads_weights_from, session_options

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    siblings = {p.stem for p in BENCHMARKS.glob("*.py")} - set(sys.modules)
    try:
        ablation = importlib.import_module("decode_ablation")
        artifact = ArtifactStore.for_session(tmp_path_factory).decoder("fp32")
        config = DecoderConfig.from_manifest(artifact.manifest["config"])
        model_bytes, counts = lowered_model(artifact, "CPUExecutionProvider", "auto")
        assert counts["moe_experts"] == sum(config.is_moe_layer(i) for i in range(config.n_layers)) > 0
        edited = onnx.load_from_string(model_bytes)
        assert ablation.without_row_selection(edited) == counts["moe_experts"] * config.n_experts
        contrib = onnx.load_from_string(lowered_model(artifact, "CPUExecutionProvider", "contrib")[0])
        assert ablation.without_row_selection(contrib) == 0  # no Ifs to edit: the script skips the variant
        for node in edited.graph.node:
            if node.op_type == "If" and "/experts" in node.name:
                ops = {n.op_type for n in next(a.g for a in node.attribute if a.name == "then_branch").node}
                assert not ops & {"NonZero", "Greater", "Squeeze", "Unsqueeze", "ScatterND"} and "Gemm" in ops, ops
        options = reads_weights_from(session_options(2), artifact)
        lowered, ablated = (ort.InferenceSession(m, options, providers=["CPUExecutionProvider"])
                            for m in (model_bytes, edited.SerializeToString()))
        (kh, kd), (vh, vd) = config.kv_cache_dims
        rng = np.random.default_rng(0)
        for tokens in (1, 12):
            feed = {"input_ids": rng.integers(0, config.vocab_size, (1, tokens))}
            for i in range(config.n_layers):
                feed[f"past_key_values.{i}.key"] = np.zeros((1, kh, 0, kd), np.float32)
                feed[f"past_key_values.{i}.value"] = np.zeros((1, vh, 0, vd), np.float32)
            expected, got = lowered.run(["logits"], feed)[0], ablated.run(["logits"], feed)[0]
            assert np.isfinite(expected).all() and np.abs(expected).max() > 0
            if tokens == 1:
                np.testing.assert_array_equal(got, expected)
            else:
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        for name in siblings:
            sys.modules.pop(name, None)


def test_decode_ablation_fixed_experts_is_the_first_k_experts_inlined(tmp_path_factory, monkeypatch) -> None:
    """fixed-experts replaces each layer's experts by its first k (the routing's top-k), inlined
    into the main graph, each times its own routing weight (0 where the token did not pick it):
    its logits must be eager PyTorch's with every MoE computing exactly that sum, written here
    by hand, and must differ from the real decoder's (the variant is a wrong answer on purpose,
    and one that changed nothing would time nothing). No If may be left, nor any row selection."""
    import importlib

    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    from moedeploy.models import moe as eager_moe
    from moedeploy.runtime.ort import lowered_model, reads_weights_from, session_options
    from tests.export.artifacts import decoder_feed, decoder_inputs, eager_decoder

    def first_k_experts(x, logits, w_gate, w_up, w_down, routing, **_):
        probs = torch.softmax(logits.float(), dim=-1)
        weights, picked = probs.topk(routing.top_k, dim=-1)
        if routing.normalize_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        dense = torch.zeros_like(probs).scatter(1, picked, weights)
        return sum(dense[:, e:e + 1] * ((torch.nn.functional.silu(x @ w_gate[e].T) * (x @ w_up[e].T)) @ w_down[e].T)
                   for e in range(routing.top_k))

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    siblings = {p.stem for p in BENCHMARKS.glob("*.py")} - set(sys.modules)
    try:
        ablation = importlib.import_module("decode_ablation")
        artifact = ArtifactStore.for_session(tmp_path_factory).decoder("fp32")
        model_bytes, counts = lowered_model(artifact, "CPUExecutionProvider", "auto")
        edited = onnx.load_from_string(model_bytes)
        top_k = eager_decoder().config.top_k
        assert ablation.fixed_experts(edited) == counts["moe_experts"] * top_k > 0
        ops = {node.op_type for node in edited.graph.node}
        assert not ops & {"If", "NonZero", "ScatterND"}, ops
        options = reads_weights_from(session_options(2), artifact)
        lowered, ablated = (ort.InferenceSession(m, options, providers=["CPUExecutionProvider"])
                            for m in (model_bytes, edited.SerializeToString()))
        decoder = eager_decoder()
        changed = []
        for tokens in (1, 12):
            _, new_ids, past = decoder_inputs(decoder, 1, 0, tokens, seed=tokens)
            feed = decoder_feed(new_ids, past)
            with torch.no_grad(), monkeypatch.context() as patch:
                patch.setattr(eager_moe, "moe", first_k_experts)
                expected = decoder(new_ids)
            got, real = ablated.run(["logits"], feed)[0], lowered.run(["logits"], feed)[0]
            np.testing.assert_allclose(got, expected.numpy(), rtol=1e-4, atol=1e-4)
            changed.append(np.abs(got - real).max())
        assert max(changed) > 1e-3  # a wrong answer on purpose (a token choosing experts 0..k-1 is the same)
    finally:
        for name in siblings:
            sys.modules.pop(name, None)


def test_the_reported_moe_path_is_the_one_the_workers_lowered() -> None:
    from moedeploy.bench.api import path_that_ran

    native = ("native", "the project's native kernel is built on this machine")
    assert path_that_ran(*native, [_timed("ort-gqa", [70.0], moe_native=8)]) == native
    assert path_that_ran(*native, [_timed("ort-gqa", [70.0], moe_experts=8)])[0] == "experts"  # biases: not taken
    assert path_that_ran("split", "the default", [_timed("ort-gqa", [70.0], moe_split=8)]) == ("split", "the default")
    assert path_that_ran(*native, []) == native  # no ort row timed: nothing says otherwise


def _timed(backend: str, rounds: list[float], **lowering: int) -> dict:
    """A merged bench result with the figures the ratios read (decode tokens/s by round) and the
    lowering counts an ONNX Runtime worker reports."""
    import statistics

    return {"backend": backend, "decode_tokens_per_s": statistics.median(rounds), "prefill_ms": 100.0,
            "peak_rss_mb": 500.0, "decode_tokens_per_s_rounds": rounds} | ({"lowering": lowering} if lowering else {})


def test_bench_reports_the_faster_moe_path() -> None:
    """Which fp32 MoE path is faster depends on the CPU: where bench times both, it says which won
    (paired by round) and how to choose it; only where the two rows really ran the two paths."""
    from moedeploy.bench.api import _ratios
    from moedeploy.bench.summary import moe_path_line

    def pair(split_rounds: list[float], experts_rounds: list[float], split_pieces: int = 8) -> dict:
        return _ratios([_timed("hf", [20.0] * len(split_rounds)),
                        _timed("ort-gqa", split_rounds, moe_split=split_pieces, moe_experts=8 - split_pieces),
                        _timed("ort-gqa-experts", experts_rounds, moe_split=0, moe_experts=8)])

    ratios = pair([60.0, 66.0, 63.0], [64.0, 66.0, 70.0])
    paired = ratios["ort-gqa_vs_ort-gqa-experts"]["decode_speedup_paired"]
    assert paired == {"median": 0.938, "by_round": [0.938, 1.0, 0.9]}  # 60/64, 66/66, 63/70
    assert ratios["ort-gqa_vs_ort-gqa-experts"]["decode_speedup"] == round(63 / 66, 3)
    assert set(ratios) == {"ort-gqa_vs_hf", "ort-gqa-experts_vs_hf", "ort-gqa_vs_ort-gqa-experts"}
    assert moe_path_line({"ratios": ratios, "settings": {"artifact": "/cache/bench/decoder-small-fp32-seed0"}}) == (
        "MoE path: the If per expert (ort-gqa-experts) decoded x1.07 the default's speed here "
        "(paired by round); `moedeploy tune /cache/bench/decoder-small-fp32-seed0` measures it on that artifact and "
        "makes the faster its path on this machine (MOEDEPLOY_MOE_PATH=experts: every CPU session's)")
    assert moe_path_line({"ratios": pair([70.0, 72.0], [64.0, 66.0])}) == (
        "MoE path: the default, experts cut into one piece per thread (ort-gqa), decoded x1.09 the If per "
        "expert's speed here (paired by round); keep it")  # 70/64 = 1.094, 72/66 = 1.091
    assert moe_path_line({"ratios": pair([66.0, 67.0], [65.0, 66.0])}).startswith(  # x1.015: within 3%
        "MoE path: no clear difference here between the default split (ort-gqa) and the If per expert")
    assert moe_path_line({"ratios": pair([60.0], [66.0])}).endswith(  # x0.91 from one round's medians
        "x1.10 the default's speed here (one round: rerun with --rounds 3 before choosing); "
        "`moedeploy tune ARTIFACT` measures it on that artifact and makes the faster its path on this machine "
        "(MOEDEPLOY_MOE_PATH=experts: every CPU session's)")
    # ort-gqa on Ifs too (one thread, MOEDEPLOY_MOE_PATH=experts, experts that cannot be cut) or
    # on QMoE (a quantized artifact): the same path twice, nothing to choose between
    assert "ort-gqa_vs_ort-gqa-experts" not in pair([60.0, 66.0], [64.0, 70.0], split_pieces=0)
    assert "ort-gqa_vs_ort-gqa-experts" not in _ratios([_timed("ort-gqa", [60.0, 66.0], moe_split=8),
                                                        _timed("ort-gqa-experts", [64.0, 70.0], moe_qmoe=8)])
    assert moe_path_line({"ratios": _ratios([_timed("ort-gqa", [70.0], moe_split=8)])}) is None


def test_bench_refuses_a_wrong_moe_path_before_any_work(monkeypatch, tmp_path) -> None:
    from moedeploy.bench.api import bench
    from moedeploy.runtime.ort import SessionError

    monkeypatch.setenv("MOEDEPLOY_MOE_PATH", "ifs")
    monkeypatch.setenv("MOEDEPLOY_CACHE", str(tmp_path))
    with pytest.raises(SessionError, match="MOEDEPLOY_MOE_PATH='ifs' is not a MoE path"):
        bench("tiny", backends=["ort-gqa"])
    assert list(tmp_path.iterdir()) == []  # nothing exported
