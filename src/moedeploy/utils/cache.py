"""Where moedeploy keeps what it makes once and reuses: bench's exports, built native kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MOEDEPLOY_CACHE, else $XDG_CACHE_HOME/moedeploy, else ~/.cache/moedeploy.

    The XDG base-directory rule: a relative XDG_CACHE_HOME is ignored.
    """
    if explicit := os.environ.get("MOEDEPLOY_CACHE"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "moedeploy"
