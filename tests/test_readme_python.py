"""The README's "From Python" snippet runs exactly as written, so it cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_snippet_after(heading: str) -> str:
    """The first ```python block that follows the line `heading` in README.md."""
    text = README.read_text()
    start = text.index(f"\n{heading}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match, f"no python block after {heading!r} in README.md"
    return match.group(1)


def test_from_python_snippet_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    code = python_snippet_after("From Python:")
    monkeypatch.chdir(tmp_path)  # the snippet writes its folders into the working directory
    torch.manual_seed(0)  # its random weights: the same run every time
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)

    # it says ONNX Runtime and eager agree, and the greedy lowering with them
    assert capsys.readouterr().out.split() == ["True", "True"]
    prompt, tokens = namespace["prompt_ids"], namespace["tokens"]
    assert tokens.shape == (len(prompt) + 16,)
    assert tokens[: len(prompt)].tolist() == list(prompt)
    # Independently of the snippet's own check: the plainest eager loop, full forward + argmax.
    model, expected = namespace["model"], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(16):
            expected = torch.cat([expected, model(expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert tokens.tolist() == expected[0].tolist() == namespace["fast"].tolist()
    assert (tmp_path / "artifacts" / "my-model" / "manifest.json").is_file()
