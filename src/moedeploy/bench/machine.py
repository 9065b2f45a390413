"""What this machine can do: memory bandwidth and GEMM rate, the roofline every figure is read against."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

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


def _cpuinfo_value(*fields: str) -> str | None:
    """The value of /proc/cpuinfo's first line naming one of `fields` (None: absent or unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(fields):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo_value("model name") or platform.processor() or "unknown"


#: the vector instruction sets ONNX Runtime's and llama.cpp's CPU kernels choose between
VECTOR_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "sve")


def cpu_features() -> list[str]:
    """Which of VECTOR_FEATURES this CPU has (/proc/cpuinfo's flags; [] where unreadable): two
    machines can share a model name ("AMD EPYC" in a VM) and not their kernels."""
    flags = set((_cpuinfo_value("flags", "Features") or "").split())
    return [name for name in VECTOR_FEATURES if name in flags]


def last_level_cache_bytes(cpu_dir: str | os.PathLike = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the CPU's largest cache level (Linux sysfs), or None where it cannot be read.

    The bandwidth probe streams 512 MB from DRAM; a decode step re-reads some of the same weights
    every token (the LM head, attention), and a last-level cache big enough to keep them serves
    them faster than DRAM, so on such a CPU a decode rate above the DRAM "bound" is no error.
    """
    sizes: dict[int, int] = {}
    for index in sorted(Path(cpu_dir).glob("index[0-9]*")):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        number, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1)
        if number.isdigit():
            sizes[level] = int(number) * unit
    return sizes[max(sizes)] if sizes else None


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
    from moedeploy.utils import huge_pages

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
        "last_level_cache_mb": round(llc / 2**20) if (llc := last_level_cache_bytes()) else None,
        "huge_pages": huge_pages.state(),  # the backends' workers' (bench.decode.run_in_subprocess)
    }
