"""In-flight batching against eager PyTorch: `compare --backend ort-inflight`.

The server's in-flight batching (serving/inflight.py) decodes rows that sit at different
positions in one step, on a lowering the artifact's interface cannot express: a shared KV
cache of rows with a past length per row, and ragged steps in which each row brings its own
number of tokens (runtime/inflight.RowCacheDecoder). Polygraphy's comparison feeds every row
the same past, so it cannot reach what is new here. This check runs a schedule the server
runs: prompts of different lengths join one per step, each prefilled in the same step that
decodes a token for every running row at its own position (a ragged step), a prompt longer
than `CHUNK` in chunks of that many over several steps while rows decode (chunked prefill,
`serve --prefill-chunk`: rows at a past length taking more than one token), then the rows
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
CHUNK = 4  # prompt tokens a step feeds a row while other rows decode
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
    fed = [0] * len(prompts)  # positions in each sequence's row
    got: list[list[tuple[int, np.ndarray]]] = [[] for _ in prompts]  # (position, logits after it)
    rows: list[int] = []  # which sequence each cache row holds
    most_rows = mixed = partial = 0

    def done(s: int) -> bool:
        return sum(position >= prompts[s] - 1 for position, _ in got[s]) > STEPS

    for step in range(len(prompts) + sum(prompts) + STEPS + 1):
        finished = [i for i, s in enumerate(rows) if done(s)]
        for i in reversed(finished):  # it leaves; the last row fills its place
            last = rows.pop()
            if i < len(rows):
                decoder.move(len(rows), i, fed[last])
                rows[i] = last
        joining = [step] if step < len(prompts) else []  # its prompt goes into the next free row
        if not rows and not joining:
            break
        decoding = [s for s in rows if fed[s] >= prompts[s]]
        chunks = []
        for s in rows + joining:
            if fed[s] >= prompts[s]:  # a seeded token, teacher-forced
                sequences[s].append(int(rng.integers(0, config.vocab_size)))
                chunks.append(np.array(sequences[s][-1:]))
            else:
                end = min(prompts[s], fed[s] + CHUNK) if decoding else prompts[s]
                chunks.append(np.array(sequences[s][fed[s]:end]))
                partial += end < prompts[s]
        lengths = np.array([fed[s] for s in rows + joining])
        mixed += bool(decoding) and len(decoding) < len(rows) + len(joining)
        rows = rows + joining
        most_rows = max(most_rows, len(rows))
        for s, chunk, logits in zip(rows, chunks, decoder.step(0, chunks, lengths), strict=True):
            fed[s] += chunk.size
            got[s].append((fed[s] - 1, logits))
    worst, within, total = 0.0, 0, 0
    for s, ids in enumerate(sequences):
        expected = _eager_logits(reference, artifact, ids)[[position for position, _ in got[s]]]
        actual = np.stack([logits for _, logits in got[s]]).astype(np.float64)
        error = np.abs(actual - expected)
        worst = max(worst, float(error.max()))
        within += int((error <= atol + rtol * np.abs(expected)).sum())
        total += error.size
    return {"backend": BACKEND, "skipped": None, "sequences": len(sequences), "prompt_lengths": prompts,
            "decode_steps": STEPS, "most_rows_in_a_step": most_rows, "steps_with_a_prompt_beside_decoding_rows": mixed,
            "prompt_chunks_before_the_last": partial,
            "positions": sum(len(g) for g in got),
            "max_abs_error": worst, "within_tolerance": within / total, "atol": atol, "rtol": rtol,
            "passed": within == total}


def _eager_logits(reference: nn.Module, artifact: Artifact, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) logits of one whole sequence from an empty cache."""
    from moedeploy.runtime.generation import EagerDecoder

    eager = EagerDecoder(artifact, reference)
    eager.reset(1)
    return eager.step(torch.tensor([ids]), 0)[0].double().numpy()
