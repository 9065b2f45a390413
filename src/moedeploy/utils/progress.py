"""Progress lines for long loops: a few lines per minute of work, none for work that is quick."""

from __future__ import annotations

import time
from collections.abc import Callable

Progress = Callable[[str], None]


def throttled(progress: Progress, every_s: float = 5.0) -> Progress:
    """`progress`, passing on a line only when `every_s` seconds have gone by since the last one
    it passed (or since it was made). A loop over a 90 GB checkpoint reports as it goes; the
    same loop over a test model, done in a second, prints nothing of its own."""
    last = [time.monotonic()]

    def report(line: str) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[0] = now
            progress(line)

    return report


def size_text(n_bytes: float) -> str:
    """Bytes as people read them in a progress line: 1.23 GB, 456.7 MB."""
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"
