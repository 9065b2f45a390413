"""What this machine can do: memory bandwidth and GEMM rate, the roofline every figure is read against."""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch


def median_seconds(fn, repeat: int, warmup: int = 3) -> float:
    """Median wall time of fn() after a few warm-up calls (the benchmarks' one timing rule)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure_bandwidth_gbs(threads: int, size_mb: int = 512, repeat: int = 5) -> float:
    """Read bandwidth: summing a buffer far larger than the caches streams it from DRAM once."""
    torch.set_num_threads(threads)
    buf = torch.ones(size_mb * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * 4 / statistics.median(times) / 1e9  # median: a min would flatter the floor


def measure_gemm_gflops(threads: int, n: int = 1024, repeat: int = 5) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def describe(threads: int) -> dict:
    import onnxruntime

    import moedeploy

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "moedeploy": moedeploy.__version__,
        "bandwidth_gbs": round(measure_bandwidth_gbs(threads), 2),
        "gemm_gflops": round(measure_gemm_gflops(threads), 1),
    }
