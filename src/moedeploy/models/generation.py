"""Token generation shared by every backend: sampling rules and the prefill/decode loop.

A backend supplies one `step(ids, start_pos) -> logits` function that runs the model on
`ids` (B, S) at absolute positions start_pos.. and updates its own KV cache; the loop and
the sampling rules are the same for eager PyTorch and ONNX Runtime, so their tokens can be
compared exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

StepFn = Callable[[torch.Tensor, int], torch.Tensor]
#: greedy_step(ids, start_pos) -> (B,) next token ids: a backend's own greedy choice
GreedyStepFn = Callable[[torch.Tensor, int], torch.Tensor]
#: What `generate` accepts as a prompt: 1-D (one sequence) or 2-D (batch) integer token ids.
TokenIds = torch.Tensor | np.ndarray | Sequence


@dataclass(frozen=True)
class SamplingConfig:
    """temperature == 0 means greedy (argmax); otherwise sample from the filtered softmax."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Prompt:
    """Token ids as the generation loop takes them: (B, S) int64; `single` remembers a 1-D
    prompt (one sequence), whose result is 1-D too."""

    ids: torch.Tensor
    single: bool

    def result(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens[0] if self.single else tokens


def as_prompt(input_ids: TokenIds, vocab_size: int) -> Prompt:
    """Check and convert what a user passes to `generate`: a torch tensor, a NumPy array or a
    (nested) list of integer token ids; 1-D is one sequence, 2-D a batch of equal lengths.

    Anything else is a ValueError naming the problem, rather than an AttributeError or an
    index error deep inside the model.
    """
    ids = _integer_tensor(input_ids)
    if ids.dim() not in (1, 2):
        raise ValueError(
            f"input_ids must be 1-D (one sequence) or 2-D (batch, seq), got shape {tuple(ids.shape)}"
        )
    if ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(ids.shape)}); give at least one token")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token id {low if low < 0 else high} is outside the vocabulary [0, {vocab_size})")
    single = ids.dim() == 1
    return Prompt(ids[None] if single else ids, single)


def _integer_tensor(input_ids: TokenIds) -> torch.Tensor:
    """input_ids as an int64 tensor (on its own device), or a ValueError if they are not integers."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
            raise ValueError(f"input_ids must hold integer token ids, got {str(input_ids.dtype).removeprefix('torch.')}")
        return input_ids.long()
    if not isinstance(input_ids, (np.ndarray, list, tuple)):
        raise ValueError(
            f"input_ids must be a torch tensor, a NumPy array or a list of token ids, got {type(input_ids).__name__}"
        )
    try:
        array = np.asarray(input_ids)
    except ValueError:  # NumPy refuses ragged nesting
        raise ValueError("input_ids rows have different lengths; pad them to one length") from None
    if array.size == 0:
        return torch.zeros(array.shape, dtype=torch.long)  # NumPy calls [] float64; it is just empty
    if array.dtype.kind not in "iu":
        raise ValueError(f"input_ids must hold integer token ids, got {array.dtype}")
    return torch.from_numpy(array.astype(np.int64))


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus. (B, V) -> (B, V)."""
    logits = logits.clone()
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass *before* it already reaches top_p; the top one always stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) logits of the last position -> (B,) next token ids."""
    logits = logits.float()
    if sampling.greedy:
        return greedy_argmax(logits)
    probs = filter_logits(scale_by_temperature(logits, sampling.temperature), sampling.top_k,
                          sampling.top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def scale_by_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, as transformers' temperature warper divides, except in a row where
    that overflows (a temperature such as 1e-45 is a valid request, and one below float32's
    least, 1e-46, divides by 0): there the row's largest logits become 0 and the rest -inf, the
    distribution a temperature tending to 0 gives (its ties sampled evenly). Without this the
    row's softmax is NaN (inf - inf) and sampling raises."""
    scaled = logits / temperature
    overflowed = ~torch.isfinite(scaled.amax(-1, keepdim=True))  # +inf in the row, or every value -inf
    if bool(overflowed.any()):
        largest = torch.where(logits == logits.amax(-1, keepdim=True), 0.0, float("-inf"))
        scaled = torch.where(overflowed, largest, scaled)
    return scaled


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1), taken by NumPy for a CPU tensor: the same index (the first maximum,
    or the first NaN, which both rank above everything), about 10x faster on a 32000-wide row
    (torch's CPU argmax is not vectorised: 60-100 µs a row, a few percent of a quantized decode
    step, and of every row's turn in the server's in-flight batch)."""
    if logits.device.type != "cpu":
        return logits.argmax(-1)
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1)))


def iterate_tokens(
    step: StepFn,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | None = None,
    greedy_step: GreedyStepFn | None = None,
) -> Iterator[torch.Tensor]:
    """Prefill the prompt once, then decode one token per step, yielding each step's (B,) new
    ids as soon as they are chosen (a stream sends them on before the next step runs).

    After a sequence emits `eos_token_id` it keeps emitting it; the loop ends early when
    every sequence has. A caller that stops iterating stops the decoding there.

    greedy_step(ids, start_pos) -> (B,) ids: a backend's own greedy choice, the argmax of the
    step's last logits computed where the logits are (ONNX Runtime's graph), used instead of
    `step` when sampling is greedy.
    """
    sampling = sampling or SamplingConfig()
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be (batch, seq) with seq >= 1, got {tuple(prompt.shape)}")
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator().manual_seed(sampling.seed)

    if greedy_step is not None and sampling.greedy:
        def choose(ids: torch.Tensor, start_pos: int) -> torch.Tensor:
            return greedy_step(ids, start_pos).cpu()
    else:
        def choose(ids: torch.Tensor, start_pos: int) -> torch.Tensor:
            return next_token(step(ids, start_pos)[:, -1].cpu(), sampling, generator)

    if max_new_tokens <= 0:  # the prefill alone: nothing is chosen, so nothing is drawn
        step(prompt, 0)
        return
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool)
    nxt = choose(prompt, 0)  # prefill
    pos = prompt.shape[1]
    for i in range(max_new_tokens):
        if eos_token_id is not None:
            nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
            finished |= nxt == eos_token_id
        yield nxt
        if i == max_new_tokens - 1 or bool(finished.all()):
            break
        nxt = choose(nxt[:, None].to(prompt.dtype).to(prompt.device), pos)
        pos += 1


def generate_tokens(
    step: StepFn,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | None = None,
    greedy_step: GreedyStepFn | None = None,
) -> torch.Tensor:
    """`iterate_tokens` to the end: the prompt with its continuation, (B, S + new) ids."""
    new = [t[:, None].to(prompt.dtype)
           for t in iterate_tokens(step, prompt, max_new_tokens, sampling, eos_token_id, greedy_step)]
    return torch.cat([prompt, *new], dim=1)


def generate(
    step: StepFn,
    prompt: torch.Tensor,
    max_positions: int,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | None = None,
    greedy_step: GreedyStepFn | None = None,
) -> torch.Tensor:
    """The `generate` API every backend exposes: checks the length, then runs the shared loop.

    `step` must start from an empty cache sized for prompt + max_new_tokens; `greedy_step`, when
    the backend has one, replaces it in greedy decoding (`iterate_tokens`).
    """
    if prompt.dim() == 2 and prompt.shape[1] + max_new_tokens > max_positions:
        raise ValueError(
            f"prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds max_positions {max_positions}"
        )
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    return generate_tokens(step, prompt, max_new_tokens, sampling, eos_token_id, greedy_step)
