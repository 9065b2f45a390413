"""What Triton prints reaches the user without the lines that report nothing wrong.

The lines below are copied verbatim from `moedeploy serve` on a machine without a GPU
(Triton 2.51 through PyTriton 0.7): each is hidden, while Triton's other lines, and real
errors, pass through whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from io import StringIO

import pytest

from moedeploy.serving.triton_output import (
    TritonOutputFilter,
    cuda_visible,
    harmless_lines,
    install,
    uninstall,
)
from tests.serving.helpers import HOST, free_ports
from tests.serving.test_cli import SHIM

WITHOUT_GPU = [
    'W1123 16:02:52.391110 4625 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, pinned memory '
    'pool will not be available: CUDA driver version is insufficient for CUDA runtime version"\n',
    'I1123 16:02:52.391175 4625 cuda_memory_manager.cc:117] "CUDA memory pool disabled"\n',
    'E1123 16:02:52.400065 4625 server.cc:241] "CudaDriverHelper has not been initialized."\n',
]
ALWAYS = ['E1123 16:02:53.277215 4625 model_repository_manager.cc:470] "Failed to set config modification time: '
          'model_config_content_name_ is empty"\n']
KEPT = [
    'I1123 16:02:52.404719 4625 http_server.cc:4713] "Started HTTPService at 127.0.0.1:18100"\n',
    'E1123 16:02:53.300000 4625 model_lifecycle.cc:654] "failed to load \'moe\' version 1: Internal: '
    'ModuleNotFoundError: No module named \'onnxruntime\'"\n',
    'E1123 16:03:23.823013 4625 main.cc:535] "failed to stop server: Internal - Exit timeout expired. Exiting immediately."\n',
    "+------------------+------+\n",
    "| Repository Agent | Path |\n",
]


def filtered(lines: list[str], gpu_visible: bool, chunk: int) -> str:
    """The lines written by another thread in `chunk`-character pieces, as PyTriton's reader does."""
    out = StringIO()
    stream = TritonOutputFilter(out, harmless_lines(gpu_visible))
    text = "".join(lines)
    writer = threading.Thread(target=lambda: [stream.write(text[i:i + chunk]) for i in range(0, len(text), chunk)])
    writer.start()
    writer.join()
    return out.getvalue()


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_known_harmless_lines_are_hidden_and_the_rest_pass_whole(chunk: int) -> None:
    lines = [WITHOUT_GPU[0], KEPT[0], ALWAYS[0], KEPT[1], WITHOUT_GPU[2], KEPT[2], WITHOUT_GPU[1], KEPT[3], KEPT[4]]
    assert filtered(lines, gpu_visible=False, chunk=chunk) == "".join(KEPT)


def test_with_a_gpu_the_cuda_lines_pass_they_would_mean_a_broken_driver() -> None:
    lines = [*WITHOUT_GPU, *ALWAYS, KEPT[0]]
    assert filtered(lines, gpu_visible=True, chunk=13) == "".join([*WITHOUT_GPU, KEPT[0]])


def test_a_triton_chunk_never_splices_into_a_line_of_ours() -> None:
    out = StringIO()
    stream = TritonOutputFilter(out, harmless_lines(False))
    stream.write(KEPT[0][:1])  # this thread plays PyTriton's reader: its "I" waits for the rest of its line
    other = threading.Thread(target=lambda: stream.write("Ctrl-C or SIGTERM stops it\n"))
    other.start()
    other.join()
    stream.write(KEPT[0][1:])
    assert out.getvalue() == "Ctrl-C or SIGTERM stops it\n" + KEPT[0]


def test_uninstall_restores_stdout_and_hands_on_unfinished_text(monkeypatch: pytest.MonkeyPatch) -> None:
    original = StringIO()
    monkeypatch.setattr(sys, "stdout", original)
    wrapper = install(harmless_lines(False))
    assert sys.stdout is wrapper
    print(ALWAYS[0], end="")
    print("no newline yet", end="")
    uninstall(wrapper)
    assert sys.stdout is original
    assert original.getvalue() == "no newline yet"


def collect(stream, into: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.extend(stream), daemon=True)
    thread.start()
    return thread


def test_serve_shows_triton_without_the_harmless_lines(store) -> None:
    """The real command on a real Triton, its console output captured (no --log-file)."""
    pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton")
    http, grpc, metrics = free_ports(3)
    args = ["serve", str(store.block("moe").path), "--http-port", str(http), "--grpc-port", str(grpc),
            "--metrics-port", str(metrics), "--exit-timeout", "1"]
    proc = subprocess.Popen([sys.executable, "-c", SHIM, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "COLUMNS": "200"})
    stdout_lines: list[str] = []
    stderr_lines: list[str] = []
    readers = [collect(proc.stdout, stdout_lines), collect(proc.stderr, stderr_lines)]
    try:
        deadline = time.monotonic() + 120
        while not any("SIGTERM stops it" in line for line in stdout_lines):  # serving, and listening for signals
            assert proc.poll() is None and time.monotonic() < deadline, "".join(stdout_lines + stderr_lines)
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    stdout, stderr = "".join(stdout_lines), "".join(stderr_lines)
    assert proc.returncode == 0, stdout + stderr
    console = stdout + stderr
    hidden = [line.split("] ", 1)[1].strip() for line in (ALWAYS if cuda_visible() else [*WITHOUT_GPU, *ALWAYS])]
    if not cuda_visible():  # GPU metrics are off without a GPU: no NVML or DCGM probe
        hidden += ["Failed to initialize NVML", "DCGM unable to start"]
    for message in hidden:
        assert message not in console
    # Triton's other lines still show (it listens on a private loopback port, behind moedeploy's front)
    assert f'"Started HTTPService at {HOST}:' in stdout
    assert f"serving HTTP {HOST}:{http}  gRPC {HOST}:{grpc}" in stdout
    assert "successfully loaded 'moe'" in stdout
    assert "stopped (SIGTERM)" in stdout
