"""What quantization costs: a quantized decoder against the unquantized eager model it was made from.

`compare`'s elementwise check answers "does the backend compute what the artifact says?" (eager
on the dequantized weights, with fp32 tolerances). A user quantizing also asks "how far is the
quantized model from the float one?", which no elementwise tolerance answers: int4 moves a
logit by tenths. So, as llama.cpp's perplexity tool measures its quantizations against the
f16 model, on one fixed token stream (seeded, teacher-forced, up to STREAM_TOKENS positions):
  kl_mean, kl_median, kl_max
                     KL(p_float || p_quantized) of the next-token distributions, per position
                     (the median is what most positions see; a mean far above it says a few
                     positions moved a lot: in a MoE, a token whose top-k experts were near a
                     tie and changed)
  top1               the fraction of positions where both models rank the same token first
  max_logit_error    the largest |logit difference|
and, generating greedily GREEDY_TOKENS new tokens from the stream's first tokens:
  greedy_agreement   the fraction of new tokens that are the same
  greedy_prefix      how many new tokens agree before the first difference
A quantized artifact is judged by thresholds on kl_mean and top1, by its narrowest bit width
(THRESHOLDS, stated in the README); greedy agreement and the logit error are reported, not
judged: on near-flat logits (random weights) one near-tie changes every later token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

STREAM_TOKENS = 1024
GREEDY_TOKENS = 64
GREEDY_PROMPT = 64
#: per narrowest bit width: the most mean KL and the least top-1 agreement that pass, with room
#: over what was measured (KL mean / top-1: the `small` preset, random weights, on compare's
#: 1,024-token stream, int4 0.0086 / 0.31, and on bench's 512-token stream int8 0.0002 / 0.95,
#: int4 0.0046 / 0.51; the `small` preset trained on a Markov chain, int4 0.007 / 0.98; the tests'
#: tiny Hugging Face Mixtral, whose logits span several units, int4 0.056 / 0.67). A
#: broken kernel or a wrong zero point gives KL of order 1 and top-1 near 1 / vocabulary. int4's
#: top-1 bar is low because near-flat logits (random weights, the mean top-token probability 5x
#: uniform) rank by near-ties: llama.cpp's own q4_0 agreed with its f32 on 38% to 65% of such
#: positions, and the q4_0-style codes moedeploy wrote before format 2 on 51% of this stream.
THRESHOLDS: dict[int, dict[str, float]] = {8: {"kl_mean": 0.01, "top1": 0.8}, 4: {"kl_mean": 0.15, "top1": 0.25}}
#: positions per chunk of the KL computation (a 152k vocabulary in float64 is 1.2 MB a row)
_CHUNK = 256


def distribution_metrics(reference: np.ndarray | torch.Tensor, logits: np.ndarray | torch.Tensor) -> dict[str, float]:
    """KL(p_ref || p) per position (mean, max), top-1 agreement and max |logit error| of two
    (positions, vocab) logit arrays."""
    reference, logits = torch.as_tensor(reference), torch.as_tensor(logits)
    kl, top1, error = [], 0, 0.0
    for start in range(0, reference.shape[0], _CHUNK):
        ref = reference[start:start + _CHUNK].double()
        got = logits[start:start + _CHUNK].double()
        ref_log, got_log = ref.log_softmax(-1), got.log_softmax(-1)
        kl.append((ref_log.exp() * (ref_log - got_log)).sum(-1))
        top1 += int((ref.argmax(-1) == got.argmax(-1)).sum())
        error = max(error, float((ref - got).abs().max()))
    kl_all = torch.cat(kl)
    return {"kl_mean": float(kl_all.mean()), "kl_median": float(kl_all.median()), "kl_max": float(kl_all.max()),
            "top1": top1 / reference.shape[0], "max_logit_error": error}


def greedy_metrics(reference: torch.Tensor, tokens: torch.Tensor) -> dict[str, float | int]:
    """Agreement of two greedy continuations (new tokens only)."""
    same = (reference == tokens).flatten().tolist()
    prefix = same.index(False) if False in same else len(same)
    return {"greedy_agreement": sum(same) / max(len(same), 1), "greedy_prefix": prefix}


def narrowest_bits(manifest: dict[str, Any]) -> int:
    """The fewest bits any tensor of a quantized artifact has (a mixed int4 export: 4)."""
    q = manifest["quantization"]
    return min(q["tensors"].values(), default=q["bits"])


def format_summary(q: dict[str, Any]) -> str:
    """The artifact's formats in one line for the report (each bit width and block size, with how
    many tensors have it; the LM head named when it has blocks of its own), so a reader knows
    what the figures measured: "int4 in blocks of 32: 40 tensors; int8 in blocks of 256: the LM head"."""
    from moedeploy.export.quantize import LM_HEAD, manifest_formats

    groups: dict[tuple[int, int], list[str]] = {}
    for name, f in manifest_formats(q).items():
        groups.setdefault((f.bits, f.block_size), []).append(name)
    return "; ".join(f"int{bits} in blocks of {block}: " + ("the LM head" if names == [LM_HEAD] else f"{len(names)} tensors")
                     for (bits, block), names in sorted(groups.items()))


def stream_plan(max_positions: int) -> tuple[int, int, int]:
    """(stream tokens, greedy prompt tokens, greedy new tokens) that fit the model's positions."""
    stream = min(STREAM_TOKENS, max_positions)
    prompt = min(GREEDY_PROMPT, max_positions // 4)
    return stream, prompt, min(GREEDY_TOKENS, max_positions - prompt)


def token_stream(vocab_size: int, length: int, seed: int) -> torch.Tensor:
    """The fixed (1, length) token stream: seeded uniform ids (a checkpoint may ship no text or tokenizer)."""
    return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


class Model:
    """What the measurement needs of a model: logits of a whole stream and a greedy continuation,
    from a KVDecoder (runtime/generation.py: eager PyTorch or ONNX Runtime, one loop for both)."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder

    def logits(self, stream: torch.Tensor) -> torch.Tensor:
        self.decoder.reset(1, stream.shape[1])
        return self.decoder.step(stream, 0)[0].float()

    def generate(self, prompt: torch.Tensor, new: int) -> torch.Tensor:
        return self.decoder.generate(prompt, max_new_tokens=new)[:, prompt.shape[1]:]


def quantization_accuracy(
    artifact, backends: list[str], float_decoder: Callable[[], nn.Module], seed: int = 0,
    thresholds: dict[str, float] | None = None, progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The quantization section of compare's report: each ONNX Runtime backend in `backends`
    running the quantized `artifact`, against the unquantized eager model `float_decoder()`
    builds (a DecoderWithPast; run first and freed, so it never sits beside a session's weights).
    Each backend runs twice: at accuracy level 0, the dequantized products in float (the
    format's own cost), and at the level `serve` runs it at, RUN_ACCURACY (int8 activations:
    what users get), as the row "<backend> level 4"."""
    from moedeploy.models.config import DecoderConfig
    from moedeploy.runtime.generation import EagerDecoder, OrtDecoder
    from moedeploy.runtime.quantized import RUN_ACCURACY
    from moedeploy.runtime.runners import ORT_LOWERINGS

    progress = progress or (lambda _: None)
    config = DecoderConfig.from_manifest(artifact.manifest["config"])
    bits = narrowest_bits(artifact.manifest)
    limits = dict(THRESHOLDS[bits], **(thresholds or {}))
    stream_len, prompt_len, new_tokens = stream_plan(config.max_positions)
    stream = token_stream(config.vocab_size, stream_len, seed)
    prompt = stream[:, :prompt_len]
    progress(f"quantization accuracy: the unquantized eager model on a {stream_len}-token stream")
    reference = Model(EagerDecoder(artifact, float_decoder()))
    reference_logits, reference_tokens = reference.logits(stream), reference.generate(prompt, new_tokens)
    del reference
    section: dict[str, Any] = {
        "bits": bits, "formats": format_summary(artifact.manifest["quantization"]), "thresholds": limits,
        "stream_tokens": stream_len, "greedy_prompt_tokens": prompt_len,
        "greedy_new_tokens": new_tokens, "reference": "eager PyTorch on the unquantized weights",
        "accuracy_levels": [0, RUN_ACCURACY], "backends": {},
    }
    for backend in backends:
        if backend not in ORT_LOWERINGS:
            continue  # TensorRT has no generation loop here yet
        for level in (0, RUN_ACCURACY):
            name = "onnxrt" + backend.removeprefix("ort") + (f" level {level}" if level else "")
            progress(f"quantization accuracy: {name} on the same stream")
            quantized = Model(OrtDecoder(artifact, nbits_accuracy=level, **ORT_LOWERINGS[backend]))
            result: dict[str, Any] = distribution_metrics(reference_logits, quantized.logits(stream))
            result |= greedy_metrics(reference_tokens, quantized.generate(prompt, new_tokens))
            result["passed"] = bool(result["kl_mean"] <= limits["kl_mean"] and result["top1"] >= limits["top1"])
            result["accuracy_level"] = level
            section["backends"][name] = result
            del quantized  # one session's weights at a time
    if not section["backends"]:  # compare refuses this up front; never a pass over nothing measured
        raise ValueError(f"no ONNX Runtime backend among {', '.join(backends) or 'none'} to measure the quantized "
                         f"decoder on; add one of {', '.join(ORT_LOWERINGS)}")
    section["passed"] = all(r["passed"] for r in section["backends"].values())
    return section
