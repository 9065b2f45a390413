"""`moedeploy serve` and `moedeploy triton-repo`: one clear error line for every user error
(before any server starts), and a served artifact that stops cleanly on SIGTERM and SIGINT.

The commands are taken from the `moedeploy` app itself, registered here too when the app
does not list them yet, so these tests run the commands as users get them.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.export.artifacts import eager_block
from tests.serving.helpers import HOST, free_ports, gone, stub_pids

SHIM = (
    "from moedeploy.cli import app\n"
    "from moedeploy.serving.cli import register\n"
    "if 'serve' not in {c.name for c in app.registered_commands}:\n"
    "    register(app)\n"
    "app()\n"
)


def cli_app():
    from moedeploy.cli import app
    from moedeploy.serving.cli import register

    if "serve" not in {c.name for c in app.registered_commands}:
        register(app)
    return app


def run(args: list[str]):
    result = CliRunner().invoke(cli_app(), args)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def taken_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        s.listen()
        yield s.getsockname()[1]


def error_cases(store, taken_port: int, tmp_path) -> dict[str, tuple[list[str], str]]:
    moe = str(store.block("moe").path)
    http, grpc, metrics = (str(p) for p in free_ports(3))
    ports = ["--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics]
    return {
        "missing artifact": (["serve", str(tmp_path / "nope"), *ports], "does not exist; create one with `moedeploy export`"),
        "unknown backend": (["serve", moe, "--backend", "onnx", *ports], "unknown backend 'onnx'; choose from: ort, trt, torch"),
        "bf16": (["serve", str(store.block("rmsnorm", "bf16").path), *ports], "is bf16: NumPy, and so PyTriton, has no bfloat16"),
        "port in use": (["serve", moe, "--http-port", str(taken_port), "--grpc-port", grpc, "--metrics-port", metrics],
                        f"cannot listen on 127.0.0.1:{taken_port} for http"),
        "same port twice": (["serve", moe, "--http-port", http, "--grpc-port", http, "--metrics-port", metrics],
                            "the http, grpc and metrics ports must differ"),
        "batch size 0": (["serve", moe, "--max-batch-size", "0", *ports],
                         "'--max-batch-size': Input should be greater than or equal to 1"),
        "no instances": (["serve", moe, "--instances", "0", *ports], "'--instances': Input should be greater than or equal to 1"),
        "repo no instances": (["triton-repo", moe, "--out", str(tmp_path / "repo"), "--instances", "0"],
                              "'--instances': Input should be greater than or equal to 1"),
        "stream interval 0": (["serve", moe, "--stream-interval", "0", *ports],
                              "--stream-interval must be >= 1 (tokens per streamed response), got 0"),
        "negative prefill chunk": (["serve", moe, "--prefill-chunk", "-1", *ports],
                                   "--prefill-chunk must be >= 0 (prompt tokens a step takes; 0: whole prompts), got -1"),
        "packed weights": (["serve", moe, "--packed-weights", "some", *ports],
                           "unknown --packed-weights 'some'; choose from: stream, all"),
        "accuracy level": (["serve", moe, "--accuracy-level", "8", *ports],
                           "--accuracy-level must be one of 0, 4 (4: int8 activations, fast; 0: float), got 8"),
        "repo without --out": (["triton-repo", moe], "missing --out DIR"),
        "repo without a plan": (["triton-repo", moe, "--out", str(tmp_path / "repo"), "--backend", "tensorrt"],
                                "no TensorRT plan for fp32"),
        "repo unknown kind": (["triton-repo", moe, "--out", str(tmp_path / "repo"), "--kind", "tpu"],
                              "unknown instance kind 'tpu'"),
        # options that would be ignored, or take the model past what was exported: refused, not dropped
        "repo delay without batching": (["triton-repo", moe, "--out", str(tmp_path / "repo"), "--no-dynamic-batching",
                                         "--max-queue-delay-us", "500"],
                                        "--max-queue-delay-us is the dynamic batcher's; with --no-dynamic-batching"),
        "repo batch past the range": (["triton-repo", moe, "--out", str(tmp_path / "repo"), "--max-batch-size", "1000"],
                                      "--max-batch-size 1000 exceeds the artifact's batch range (at most 16"),
        "check experts option on floats": (["check", moe, "--experts-dequantized"],
                                           "--experts-on-codes/--experts-dequantized applies to quantized artifacts"),
    }


CASES = ["missing artifact", "unknown backend", "bf16", "port in use", "same port twice", "batch size 0",
         "no instances", "repo no instances", "stream interval 0", "negative prefill chunk", "packed weights", "accuracy level", "repo without --out", "repo without a plan", "repo unknown kind",
         "repo delay without batching", "repo batch past the range", "check experts option on floats"]


USAGE_ERRORS = {"batch size 0", "no instances", "repo no instances"}


@pytest.mark.parametrize("case", CASES)
def test_user_errors_are_one_line(store, taken_port, tmp_path, case: str) -> None:
    args, message = error_cases(store, taken_port, tmp_path)[case]
    code, stdout, stderr = run(args)
    assert code == (2 if case in USAGE_ERRORS else 1)  # 2: refused as the options are parsed
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert message in " ".join(stderr.split()), stderr
    assert "Traceback" not in stdout + stderr
    assert not (tmp_path / "repo").exists()


def test_serve_with_tensorrt_says_what_is_missing(store) -> None:
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here; the missing-TensorRT message does not apply")
    http, grpc, metrics = (str(p) for p in free_ports(3))
    code, _, stderr = run(["serve", str(store.block("moe").path), "--backend", "trt",
                           "--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics])
    assert code == 1 and "error: TensorRT is not installed" in stderr


def test_triton_repo_prints_what_it_wrote(store, tmp_path) -> None:
    code, stdout, _ = run(["triton-repo", str(store.block("moe").path), "--out", str(tmp_path / "repo")])
    assert code == 0
    assert "wrote" in stdout
    # one line, whatever the terminal's width (piped, it was wrapped mid-path at 80 columns)
    assert f"start it with: tritonserver --model-repository={(tmp_path / 'repo').resolve()}\n" in stdout
    assert (tmp_path / "repo" / "moe" / "1" / "model.onnx").is_file()


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    import tritonclient.http as http

    client = http.InferenceServerClient(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if client.is_server_ready() and client.is_model_ready("moe"):
                return
        except Exception:  # not listening yet
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the server was not ready after {timeout_s} s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_cleanly_on_a_signal(store, tmp_path, sig: signal.Signals) -> None:
    pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")
    import tritonclient.http as http

    ports = free_ports(3)
    args = ["serve", str(store.block("moe").path), "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
            "--metrics-port", str(ports[2]), "--exit-timeout", "1", "--log-file", str(tmp_path / "triton.log")]
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-c", SHIM, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        url = f"{HOST}:{ports[0]}"
        wait_ready(url, proc)
        x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
        inp = http.InferInput("x", [2, 3, 64], "FP32")
        inp.set_data_from_numpy(x.numpy())
        y = http.InferenceServerClient(url).infer("moe", [inp]).as_numpy("y")
        with torch.no_grad():
            np.testing.assert_allclose(y, eager_block("moe")(x).numpy(), atol=1e-5, rtol=1e-5)
        stubs = stub_pids(proc.pid)
        assert stubs
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output
    assert gone(stubs), "PyTriton stub processes outlived the server"
    assert f"stopped ({sig.name})" in output
    assert f"HTTP {url}" in output and "moe" in output
    from moedeploy.serving.server import check_port_free

    for port, label in zip(ports, ("http", "grpc", "metrics"), strict=True):
        check_port_free(HOST, port, label)


def test_serve_help_says_what_the_generation_options_take() -> None:
    """One value per request, sent as [batch, 1] with the same value in every row: what the
    server accepts (a request whose rows differ is refused, see test_bad_requests)."""
    code, stdout, _ = run(["serve", "--help"])
    text = " ".join(stdout.split())
    assert code == 0
    assert "one value per request" in text and "the same value in every row" in text
    assert "one value per sequence" not in text
    assert "--max-request-mb" in text


def test_serve_defaults_to_the_level_quantized_artifacts_run_at() -> None:
    """serve's --accuracy-level default is a literal (the CLI module loads no torch for --help):
    held equal to runtime.quantized.RUN_ACCURACY and ServeOptions' default here."""
    import typer

    from moedeploy.runtime.quantized import RUN_ACCURACY
    from moedeploy.serving import ServeOptions

    command = typer.main.get_command(cli_app()).commands["serve"]
    (default,) = [p.default for p in command.params if p.name == "accuracy_level"]
    assert default == ServeOptions().accuracy_level == RUN_ACCURACY


def test_serve_defaults_to_the_schedulers_prefill_chunk() -> None:
    """serve's --prefill-chunk default is a literal too: held equal to
    serving.inflight.DEFAULT_PREFILL_CHUNK and ServeOptions' default here."""
    import typer

    from moedeploy.serving import ServeOptions
    from moedeploy.serving.inflight import DEFAULT_PREFILL_CHUNK

    command = typer.main.get_command(cli_app()).commands["serve"]
    (default,) = [p.default for p in command.params if p.name == "prefill_chunk"]
    assert default == ServeOptions().prefill_chunk == DEFAULT_PREFILL_CHUNK
