"""In-flight batching against eager PyTorch: `compare --backend ort-inflight`.

The server's in-flight batching (serving/inflight.py) decodes rows that sit at different
positions in one step, on a lowering the artifact's interface cannot express: a shared KV
cache of rows with a past length per row, and ragged steps in which each row brings its own
number of tokens (runtime/inflight.RowCacheDecoder). Polygraphy's comparison feeds every row
the same past, so it cannot reach what is new here. This check runs a schedule the server
runs: prompts of different lengths join one per step, each prefilled in the same step that
decodes a token for every running row at its own position (a ragged step), then the rows
decode together, and the first sequence to finish leaves while the others go on (the last row
moves into its place, as the scheduler packs rows). The tokens fed are seeded random ids
(teacher-forced, so no argmax near-tie can change what follows). Every logit the rows produce
is compared with eager PyTorch's for that sequence run whole, with the artifact's logits
tolerance.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from moedeploy.export.artifact import Artifact
from moedeploy.models.config import DecoderConfig
from moedeploy.runtime import gqa

BACKEND = "ort-inflight"
PROMPTS = (3, 7, 5, 11)  # prompt lengths; sequence i joins in step i
STEPS = 6  # decode steps each sequence runs after its prompt


def inflight_accuracy(artifact: Artifact, reference: nn.Module, atol: float, rtol: float, seed: int = 0) -> dict[str, Any]:
    """The schedule above on ONNX Runtime's row cache against `reference` (the eager decoder
    with the artifact's interface: input_ids, past -> logits, present)."""
    from moedeploy.runtime.inflight import RowCacheDecoder

    config = DecoderConfig.from_manifest(artifact.manifest["config"])
    if why := gqa.eligible(config):
        return {"backend": BACKEND, "skipped": f"{why}: GroupQueryAttention cannot take this attention, so the "
                "server decodes its streams one request at a time", "passed": True}
    prompts = [min(n, config.max_positions - STEPS - 1) for n in PROMPTS]
    capacity = max(prompts) + STEPS + 1
    # (level 0, the default: a quantized artifact's dequantized products, held to the float tolerances)
    decoder = RowCacheDecoder(artifact, slots=len(prompts), capacity=capacity)
    rng = np.random.default_rng(seed)
    sequences = [rng.integers(0, config.vocab_size, n).tolist() for n in prompts]
    got: list[list[np.ndarray]] = [[] for _ in prompts]
    rows: list[int] = []  # which sequence each cache row holds
    most_rows = mixed = 0
    for step in range(len(prompts) + STEPS + 1):
        finished = [i for i, s in enumerate(rows) if len(got[s]) > STEPS]
        for i in reversed(finished):  # it leaves; the last row fills its place
            last = rows.pop()
            if i < len(rows):
                decoder.move(len(rows), i, len(sequences[last]))
                rows[i] = last
        joining = [step] if step < len(prompts) else []  # its prompt goes into the next free row
        if not rows and not joining:
            break
        tokens = [int(rng.integers(0, config.vocab_size)) for _ in rows]
        lengths = [len(sequences[s]) for s in rows] + [0] * len(joining)
        for s, token in zip(rows, tokens, strict=True):
            sequences[s].append(token)
        chunks = [np.array([token]) for token in tokens] + [np.array(sequences[s]) for s in joining]
        mixed += bool(rows and joining)
        rows = rows + joining
        most_rows = max(most_rows, len(rows))
        for s, logits in zip(rows, decoder.step(0, chunks, np.array(lengths)), strict=True):
            got[s].append(logits)
    worst, within, total = 0.0, 0, 0
    for s, ids in enumerate(sequences):
        expected = _eager_logits(reference, artifact, ids)[-len(got[s]):]
        actual = np.stack(got[s]).astype(np.float64)
        error = np.abs(actual - expected)
        worst = max(worst, float(error.max()))
        within += int((error <= atol + rtol * np.abs(expected)).sum())
        total += error.size
    return {"backend": BACKEND, "skipped": None, "sequences": len(sequences), "prompt_lengths": prompts,
            "decode_steps": STEPS, "most_rows_in_a_step": most_rows, "steps_with_a_prompt_beside_decoding_rows": mixed,
            "positions": sum(len(g) for g in got),
            "max_abs_error": worst, "within_tolerance": within / total, "atol": atol, "rtol": rtol,
            "passed": within == total}


def _eager_logits(reference: nn.Module, artifact: Artifact, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) logits of one whole sequence from an empty cache."""
    from moedeploy.runtime.generation import EagerDecoder

    eager = EagerDecoder(artifact, reference)
    eager.reset(1)
    return eager.step(torch.tensor([ids]), 0)[0].double().numpy()
