"""Stand-ins for llama.cpp's stream logits that a spawned child runs (tests/test_bench_peers.py):
a module of its own with no heavy imports, so each child starts in a fraction of a second."""

from __future__ import annotations

import os
import signal
import time


def segfaults_with_extra_buffers(gguf: str, ids: list[int], threads: int, extra_buffers: bool) -> list[int]:
    """Stands in for llama.cpp's stream logits in a spawned child: a real SIGSEGV of the child while
    `extra_buffers` is on, the ids doubled when it is off."""
    if extra_buffers:
        os.kill(os.getpid(), signal.SIGSEGV)
    return [2 * i for i in ids]


def always_segfaults(gguf: str, ids: list[int], threads: int, extra_buffers: bool) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def raises_value_error(gguf: str, ids: list[int], threads: int, extra_buffers: bool) -> None:
    raise ValueError("no such model")


def sleeps(gguf: str, ids: list[int], threads: int, extra_buffers: bool) -> None:
    time.sleep(60)
