"""Helpers for the accuracy-comparison tests: artifact copies, weight corruption, the CLI,
headless Chromium and independent (numpy) error statistics."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from moedeploy.export.artifact import Artifact
from tests.export.artifacts import rewrite_manifest

SCOPE_KEY = "pkg.torch.onnx.name_scopes"
# A cross-section of the blocks: custom ops (RMSNorm, MoE), a folded BatchNorm, attention.
BLOCK_NAMES = ("rmsnorm", "layernorm", "moe", "batchnorm_mlp", "decoder_layer")
COMPARED_ITERATIONS = 3  # of the session's compared_decoder


# --- artifacts --------------------------------------------------------------------------


def fresh_copy(artifact: Artifact | Path, dest: Path) -> Path:
    """A private copy of an artifact folder, so each test owns its report/ folder. What other
    tests derived from the shared artifact (a report, ONNX Runtime's lowered-graph cache, TensorRT
    engines) stays behind: the copy is the artifact as exported."""
    src = artifact.path if isinstance(artifact, Artifact) else Path(artifact)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("cache", "report", "engines"))
    return dest


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rehash_model(folder: Path) -> None:
    """What a buggy exporter would do: record the sha256 of the (wrong) model it wrote."""
    manifest_file = folder / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["files"]["model.onnx"] = file_sha256(folder / "model.onnx")
    rewrite_manifest(folder, manifest)


def edit_initializer(folder: Path, name: str, edit: Callable[[np.ndarray], np.ndarray]) -> None:
    """Replace one initializer of <folder>/model.onnx by edit(its value)."""
    model = onnx.load(str(folder / "model.onnx"))
    for init in model.graph.initializer:
        if init.name == name:
            value = numpy_helper.to_array(init).copy()
            init.CopyFrom(numpy_helper.from_array(edit(value), name))
            break
    else:
        raise KeyError(f"no initializer {name!r} in {folder / 'model.onnx'}")
    onnx.save(model, str(folder / "model.onnx"))


def initializer(folder: Path, name: str) -> np.ndarray:
    model = onnx.load(str(folder / "model.onnx"))
    return next(numpy_helper.to_array(i) for i in model.graph.initializer if i.name == name)


def _scopes(node: onnx.NodeProto) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == SCOPE_KEY:
            return list(ast.literal_eval(prop.value))
    return []


def initializer_of_module(folder: Path, module: str, op_type: str = "MatMul") -> str:
    """The initializer feeding the `op_type` node recorded as belonging to `module`
    (attention projections are renamed `val_N` by the optimizer; their nodes keep the scope)."""
    model = onnx.load(str(folder / "model.onnx"))
    inits = {i.name for i in model.graph.initializer}
    found = [
        name
        for node in model.graph.node
        if node.op_type == op_type and module in _scopes(node)
        for name in node.input
        if name in inits
    ]
    if len(found) != 1:
        raise LookupError(f"expected one initializer for {module} ({op_type}), found {found}")
    return found[0]


# --- independent statistics -------------------------------------------------------------


def numpy_stats(ref: np.ndarray, act: np.ndarray) -> dict[str, float]:
    """The report's statistics, computed from their textbook definitions."""
    r = np.asarray(ref, dtype=np.float64).ravel()
    a = np.asarray(act, dtype=np.float64).ravel()
    d = np.abs(a - r)
    rel = d / np.maximum(np.abs(r), 1e-12)
    return {
        "max_abs": d.max(),
        "mean_abs": d.sum() / d.size,
        "median_abs": np.percentile(d, 50),
        "p99_abs": np.percentile(d, 99),
        "max_rel": rel.max(),
        "mean_rel": rel.sum() / rel.size,
        "median_rel": np.percentile(rel, 50),
        "p99_rel": np.percentile(rel, 99),
        "cosine": float(np.dot(r, a) / (np.sqrt(np.dot(r, r)) * np.sqrt(np.dot(a, a)))),
    }


# --- the command line -------------------------------------------------------------------


def run_cli(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`moedeploy ...` as a user runs it (the console script next to this interpreter)."""
    script = Path(sys.executable).with_name("moedeploy")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "moedeploy.cli"]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [*cmd, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 1, no traceback, exactly one `error:` line on stderr mentioning every fragment."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# --- headless Chromium ------------------------------------------------------------------


def chromium() -> str | None:
    if Path("/usr/bin/chromium").is_file():
        return "/usr/bin/chromium"
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(html: Path, png: Path, workdir: Path, netlog: Path | None = None) -> None:
    """Render `html` in headless Chromium with background networking off; write `png`."""
    exe = chromium()
    assert exe is not None
    profile = workdir / f"profile-{png.stem}"
    profile.mkdir(parents=True)
    cmd = [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--window-size=1280,2000", f"--screenshot={png}",
    ]
    if netlog is not None:
        cmd.append(f"--log-net-log={netlog}")
    result = subprocess.run([*cmd, html.resolve().as_uri()], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert png.is_file(), result.stderr[-2000:]


def page_requests(netlog: Path) -> list[str]:
    """URLs the *page* asked the network for (Chromium's own background traffic has no
    page initiator: its initiator reads 'not an origin')."""
    log = json.loads(netlog.read_text())
    names = {v: k for k, v in log["constants"]["logEventTypes"].items()}
    urls = []
    for event in log["events"]:
        params = event.get("params") or {}
        if names.get(event["type"]) != "URL_REQUEST_START_JOB" or "url" not in params:
            continue
        if params.get("initiator") != "not an origin" or "file://" in params.get("network_isolation_key", ""):
            urls.append(params["url"])
    return urls


def load_png(path: Path) -> np.ndarray:
    """RGB uint8 pixels of a PNG, decoded by matplotlib (not by the code under test)."""
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    if pixels.dtype != np.uint8:
        pixels = np.round(pixels * 255).astype(np.uint8)
    return pixels[..., :3]


def count_colour(pixels: np.ndarray, rgb: tuple[int, int, int], tol: int = 12) -> int:
    diff = np.abs(pixels.astype(np.int16) - np.array(rgb, dtype=np.int16))
    return int(np.all(diff <= tol, axis=-1).sum())


def distinct_colours(pixels: np.ndarray) -> int:
    """How many different RGB colours the image holds (uint8 channels). Each pixel is packed
    into one integer first: np.unique over rows (axis=0) sorts a screenshot's 2.5 million
    pixels as records, 15 s here, where the packed values take a fraction of a second."""
    assert pixels.dtype == np.uint8, pixels.dtype  # 8 bits a channel: the packing is one-to-one
    rgb = pixels.reshape(-1, 3).astype(np.uint32)
    return len(np.unique((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]))
