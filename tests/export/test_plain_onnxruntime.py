"""An exported model.onnx runs in a bare onnxruntime process: nothing of moedeploy (or torch)
is imported there; ONNX Runtime inlines the custom ops' function bodies itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from tests.export.artifacts import decoder_feed, decoder_inputs, eager_block, eager_decoder

RUNNER = r"""
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

model, folder = sys.argv[1], Path(sys.argv[2])
session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
feed = {i.name: np.load(folder / "in" / f"{i.name}.npy") for i in session.get_inputs()}
names = [o.name for o in session.get_outputs()]
(folder / "out").mkdir()
for name, value in zip(names, session.run(names, feed)):
    np.save(folder / "out" / f"{name}.npy", value)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("moedeploy", "torch", "onnx", "onnxscript"))
assert not leaked, leaked
print("ok", len(names))
"""


def run_bare(model: Path, feed: dict[str, np.ndarray], folder: Path) -> dict[str, np.ndarray]:
    (folder / "in").mkdir(parents=True)
    for name, value in feed.items():
        np.save(folder / "in" / f"{name}.npy", value)
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, str(model), str(folder)],
        capture_output=True, text=True, timeout=120, cwd=folder,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
    return {p.stem: np.load(p) for p in (folder / "out").glob("*.npy")}


def test_moe_block_in_a_bare_onnxruntime_process(store, tmp_path: Path) -> None:
    artifact = store.block("moe")
    x = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(3))
    outputs = run_bare(artifact.model_path, {"x": x.numpy()}, tmp_path)
    with torch.no_grad():
        expected = eager_block("moe")(x).numpy()
    assert set(outputs) == {"y"}
    np.testing.assert_allclose(outputs["y"], expected, rtol=1e-5, atol=1e-5)


def test_decoder_in_a_bare_onnxruntime_process(store, tmp_path: Path) -> None:
    artifact = store.decoder("fp32")
    decoder = eager_decoder()
    ids, new_ids, past = decoder_inputs(decoder, 3, 4, 6, seed=21)
    outputs = run_bare(artifact.model_path, decoder_feed(new_ids, past), tmp_path)
    with torch.no_grad():
        full = decoder(ids)[:, 4:].numpy()
    assert set(outputs) == {"logits"} | {f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")}
    np.testing.assert_allclose(outputs["logits"], full, rtol=1e-4, atol=1e-4)
    assert outputs["present.1.value"].shape == (3, 2, 10, 16)
