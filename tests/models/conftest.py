"""Shared settings for the eager-model tests: nothing is downloaded, runs are deterministic."""

from __future__ import annotations

import os
from collections.abc import Iterator

# Set before transformers is imported by any test module: every Hugging Face model here is
# built from a config in the test, and a test that tried to reach the Hub should fail loudly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_single_thread() -> Iterator[None]:
    """Seed every test, and run it on one thread.

    These models are tiny: a second intra-op thread buys nothing, and on a busy 2-core
    machine OpenMP's spinning barriers made a 0.05 s test take 15 s.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    assert torch.get_default_dtype() == torch.float32
    try:
        yield
    finally:
        torch.set_num_threads(threads)
