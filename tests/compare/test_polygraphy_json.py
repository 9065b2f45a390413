"""The Polygraphy JSON that compare saves is Polygraphy's own: its loaders and CLI read it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from polygraphy.comparator import AccuracyResults, RunResults

from tests.compare.helpers import COMPARED_ITERATIONS

RUNNERS = ["torch-eager", "onnxrt"]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_run_results_load_with_polygraphy(compared_decoder):
    folder, report = compared_decoder
    manifest = _manifest(folder)
    outputs = [o["name"] for o in manifest["outputs"]]
    results = RunResults.load(str(folder / "report" / report["polygraphy"]["run_results"]))
    assert [name for name, _ in results.items()] == RUNNERS
    for runner in RUNNERS:
        iterations = results[runner]
        assert len(iterations) == COMPARED_ITERATIONS
        for it in iterations:
            assert list(it.keys()) == outputs
            assert it.runner_name == runner
            for name in outputs:
                assert isinstance(it[name], np.ndarray) and it[name].dtype == np.float32
    # iteration 0 ran at the opt sizes: logits are (batch, seq, vocab)
    ranges = manifest["dynamic_ranges"]
    vocab = manifest["config"]["vocab_size"]
    for runner in RUNNERS:
        assert results[runner][0]["logits"].shape == (ranges["batch"]["opt"], ranges["seq"]["opt"], vocab)
        total = ranges["past_seq"]["opt"] + ranges["seq"]["opt"]
        assert results[runner][0]["present.0.key"].shape[2] == total


def test_accuracy_results_load_with_polygraphy(compared_decoder):
    folder, report = compared_decoder
    outputs = [o["name"] for o in _manifest(folder)["outputs"]]
    accuracy = AccuracyResults.load(str(folder / "report" / report["polygraphy"]["accuracy"]))
    pairs = [(pair, iterations) for result in accuracy for pair, iterations in result.items()]
    assert [tuple(pair) for pair, _ in pairs] == [tuple(RUNNERS)]
    (_, iterations), = pairs
    assert len(iterations) == COMPARED_ITERATIONS
    for it in iterations:
        assert sorted(it.keys()) == sorted(outputs)
        assert all(bool(it[name]) for name in outputs)  # a correct export passes every output


def test_polygraphy_cli_inspects_the_run_results(compared_decoder):
    folder, _ = compared_decoder
    polygraphy = Path(sys.executable).with_name("polygraphy")
    assert polygraphy.is_file(), "polygraphy's console script is installed with the package"
    result = subprocess.run(
        [str(polygraphy), "inspect", "data", str(folder / "report" / "run_results.json")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout + result.stderr
    assert "torch-eager" in text and "onnxrt" in text
    assert f"({COMPARED_ITERATIONS} iterations)" in text
    assert "logits" in text
