"""Decoder weights as a stream: read one tensor (or one expert) at a time, never the model at once.

A real MoE checkpoint is tens of GB. Export writes its weights tensor by tensor, the weights
fingerprint hashes them tensor by tensor, and the eager reference of a model that barely
fits runs layer by layer (`layered_decoder`): each needs only a `WeightSource`, which a
checkpoint folder (`CheckpointWeights`) and an in-memory model (`ModuleWeights`) both are.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn

from moedeploy.models.config import DecoderConfig
from moedeploy.utils.progress import throttled


class WeightSource(Protocol):
    """Our tensors by name (`MoEDecoder.state_dict()` names), read on demand."""

    config: DecoderConfig

    def names(self) -> list[str]:
        """Every state-dict name in `MoEDecoder.state_dict()` order (a tied lm_head included)."""
        ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, in the source's dtype."""
        ...

    def experts(self, name: str) -> Iterator[torch.Tensor]:
        """A stacked (E, out, in) expert tensor one (out, in) expert at a time."""
        ...

    def block(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The part `index` of a tensor (rows or columns of a 2-D weight), read alone."""
        ...


class ModuleWeights:
    """The weights of an in-memory MoEDecoder (a preset with seeded random weights)."""

    def __init__(self, decoder: nn.Module) -> None:
        self.module = decoder
        self.config: DecoderConfig = decoder.config
        self._state = decoder.state_dict()

    def names(self) -> list[str]:
        return list(self._state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape)

    def tensor(self, name: str) -> torch.Tensor:
        return self._state[name].detach()

    def experts(self, name: str) -> Iterator[torch.Tensor]:
        yield from self._state[name].detach()

    def block(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._state[name].detach()[index]


def is_expert_tensor(source: WeightSource, name: str) -> bool:
    """The stacked (E, out, in) expert weights: streamed per expert, the biggest tensors by far."""
    return len(source.shape(name)) == 3


#: The most bytes of a 2-D weight read at once (a 152k-token embedding is 1.2 GB in fp32).
BLOCK_BYTES = 64 * 2**20


def chunks(source: WeightSource, name: str, dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
    """A tensor's values in `dtype` (None: as stored), contiguous, in order: per expert for
    expert weights, in blocks of rows for large 2-D ones."""
    shape = source.shape(name)
    if is_expert_tensor(source, name):
        pieces = source.experts(name)
    elif len(shape) == 2:
        pieces = (source.block(name, (slice(r, r + step),)) for r, step in _blocks(shape))
    else:
        pieces = iter([source.tensor(name)])
    for piece in pieces:
        yield (piece if dtype is None else piece.to(dtype)).contiguous()


def interleaved_chunks(source: WeightSource, gate: str, up: str, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The experts' gate and up rows alternating, (2I, H) per expert, one expert at a time."""
    for g, u in zip(source.experts(gate), source.experts(up), strict=True):
        yield torch.stack([g, u], dim=1).reshape(2 * g.shape[0], g.shape[1]).to(dtype).contiguous()


def transposed_chunks(source: WeightSource, name: str, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """W^T of a 2-D weight, in order, in blocks: its rows are W's columns, read a block at a time."""
    rows, cols = source.shape(name)
    for c, step in _blocks((cols, rows)):
        yield source.block(name, (slice(None), slice(c, c + step))).to(dtype).t().contiguous()


def _blocks(shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """(start, count) of row blocks of a 2-D shape, each at most BLOCK_BYTES in fp32."""
    rows, cols = shape
    step = max(1, BLOCK_BYTES // (4 * max(cols, 1)))
    for start in range(0, rows, step):
        yield start, min(step, rows - start)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy (bf16 included)."""
    t = t.detach().cpu().contiguous().reshape(-1)  # 0-d tensors too
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def fingerprint(
    source: WeightSource, dtype: torch.dtype | None = None, progress: Callable[[str], None] | None = None,
    inspect: Callable[[str, torch.Tensor], None] | None = None,
) -> str:
    """sha256 over every tensor's name and bytes in `dtype`, in state-dict order.

    Streamed one expert at a time, and equal to `fingerprint(ModuleWeights(m), dtype)` of the
    model loaded whole: it proves a rebuilt reference holds the weights an artifact was exported from.
    `progress` hears how far it got every few seconds; `inspect(name, piece)` sees every piece
    hashed (the one pass over all the weights an export makes before writing: `require_finite`).
    """
    report = throttled(progress or (lambda _: None))
    digest = hashlib.sha256()
    names = source.names()
    for i, name in enumerate(names, 1):
        digest.update(name.encode())
        for piece in chunks(source, name, dtype):
            if inspect is not None:
                inspect(name, piece)
            digest.update(tensor_bytes(piece))
        report(f"fingerprinting the weights: {i} of {len(names)} tensors")
    return digest.hexdigest()


def require_finite(name: str, piece: torch.Tensor, stored_as: Callable[[], str] | None = None) -> None:
    """Refuse a weight holding NaN or infinity: every output of the model would be NaN, and a
    comparison would blame the first layer it reaches instead of the weight. `stored_as()`:
    where the source keeps it, in its own names (asked only when the weight is refused)."""
    if piece.is_floating_point() and not bool(torch.isfinite(piece).all()):
        nan, inf = int(torch.isnan(piece).sum()), int(torch.isinf(piece).sum())
        wide = (f" (in {str(piece.dtype).removeprefix('torch.')} an infinity can be a value past its range, ±65504 "
                "for fp16: export with --dtype fp32 or bf16)" if piece.dtype == torch.float16 and inf else "")
        where = f" (stored as {stored_as()})" if stored_as is not None else ""
        raise ValueError(f"weight {name}{where} holds {nan} NaN and {inf} infinite values{wide}; a model with them "
                         "computes NaN: fix the checkpoint")


def finite_check(source: WeightSource) -> Callable[[str, torch.Tensor], None]:
    """`require_finite` for `fingerprint`'s pass over the source's pieces, naming the tensor as the
    source stores it where the source can say (a checkpoint's `stored_as`): its own tensor name,
    file and expert, not only ours. Pieces of an expert tensor come one expert at a time, in order."""
    where = getattr(source, "stored_as", None)
    seen: collections.Counter[str] = collections.Counter()

    def inspect(name: str, piece: torch.Tensor) -> None:
        index = seen[name]
        seen[name] += 1
        expert = index if is_expert_tensor(source, name) else None
        require_finite(name, piece, None if where is None else lambda: where(name, expert))

    return inspect


#: The modules whose weights `layered_decoder` loads just before their forward and drops after.
def _weight_units(decoder: nn.Module) -> list[tuple[str, nn.Module]]:
    return [("embed", decoder.embed), *[(f"layers.{i}", m) for i, m in enumerate(decoder.layers)],
            ("norm", decoder.norm), ("lm_head", decoder.lm_head)]


def layered_decoder(
    source: WeightSource, dtype: torch.dtype, progress: Callable[[str], None] | None = None
) -> nn.Module:
    """An eval-mode MoEDecoder whose weights live in `source` and are loaded one layer at a time.

    Each unit (the embedding, every decoder layer, the final norm, the LM head) gets its
    weights read and cast just before its forward and dropped right after, so running the
    model needs one layer's weights in memory, not the model's: the eager reference for a
    checkpoint that barely fits. Every forward reads the weights again (from the page
    cache once warm), so this trades speed for memory; it computes exactly what the model
    loaded whole computes. `progress` hears which decoder layer is done, every few seconds.
    """
    from moedeploy.models.decoder import MoEDecoder, rotary_embedding

    config = source.config
    with torch.device("meta"):
        decoder = MoEDecoder(config).to(dtype)
    decoder.rope = rotary_embedding(config)
    decoder.layered_source = source  # a reader of the model can tell it is streamed
    report = None if progress is None else throttled(progress)
    for prefix, unit in _weight_units(decoder):
        unit.register_forward_pre_hook(_loader(source, prefix, dtype))
        unit.register_forward_hook(_unloader(prefix), always_call=True)  # even when forward raises
        if report is not None and prefix.startswith("layers."):
            done = f"eager PyTorch: layer {int(prefix.split('.')[1]) + 1} of {config.n_layers} done"
            unit.register_forward_hook(lambda *_, line=done: report(line))
    return decoder.eval()


def _loader(source: WeightSource, prefix: str, dtype: torch.dtype):
    def load(module: nn.Module, _args) -> None:
        for name, _ in list(module.named_parameters()):
            value = source.tensor(f"{prefix}.{name}").to(dtype)
            _set(module, name, nn.Parameter(value, requires_grad=False))
    return load


def _unloader(_prefix: str):
    def unload(module: nn.Module, _args, _output) -> None:
        for name, param in list(module.named_parameters()):
            _set(module, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                            requires_grad=False))
    return unload


def _set(module: nn.Module, dotted: str, param: nn.Parameter) -> None:
    owner_path, _, leaf = dotted.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    owner._parameters[leaf] = param
