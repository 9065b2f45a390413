"""One KV cache of many rows on ONNX Runtime, for sequences that start and stop at different times.

In-flight (continuous) batching decodes every running sequence in one step although each
joined at its own time and so sits at its own position. The decoder's attention runs on
GroupQueryAttention with a shared-buffer cache (runtime/gqa.py), which takes each row's past
length as an input and rotates, writes and attends every row at its own positions. This
module owns the buffers: one per layer's key and value, `slots` rows of `capacity`
positions, preallocated (zero pages are only touched as rows fill). Rows 0..n-1 are the
running sequences, kept packed so that a step binds one contiguous view of them:

- `step(first_row, chunks, lengths)` runs one step in which each of the rows first_row..
  brings its own tokens at its own past length: one token for a row that decodes, a prompt
  or a chunk of one (after the chunks before it) for a row being prefilled, so a prompt is
  prefilled in the same step (one pass over the weights) as the rows that keep decoding. The graph is lowered for it (kv_cache="ragged",
  runtime/gqa.py): every token of the step packed in one input, each layer's attention on
  the rows' right-padded chunks;
- `prefill(first_row, ids)` and `decode(first_row, ids, lengths)`, the two uniform steps:
  prompts of one length from an empty past, one token per row;
- `move(src, dst, length)` copies a row's cache into another, to close the gap a finished
  sequence leaves.

Views of numpy buffers are bound with IO binding: ONNX Runtime reads and writes the rows
where they lie, and no step copies the cache. GroupQueryAttention wants room in each row for
the step's whole padded chunk (a row's past + the longest chunk of the step; it may write
padding past a row's length, which is never read and is overwritten by the row's next
tokens), so each row has `capacity` positions for its sequence and as many again for that:
their pages are touched only when a long prompt joins rows near their end. Not thread-safe:
one scheduler owns it.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from moedeploy.export.artifact import NP_DTYPES, Artifact
from moedeploy.export.decoder import past_names, past_shapes
from moedeploy.models.config import DecoderConfig
from moedeploy.runtime.gqa import (
    PADDED_TOKENS,
    PAST_LENGTHS,
    QUERY_LENGTHS,
    TOKEN_SLOTS,
    ragged_indices,
)
from moedeploy.runtime.lowering import LoweringError, MoELowering
from moedeploy.runtime.ort import create_session


class RowCacheDecoder:
    """The decoder artifact on ONNX Runtime with a KV cache of `slots` rows x `capacity` positions."""

    def __init__(self, artifact: Artifact | str, slots: int, capacity: int | None = None,
                 providers: list[str] | None = None, moe_lowering: MoELowering = "auto",
                 threads: int | None = None, nbits_accuracy: int = 0) -> None:
        """capacity: positions a row holds (prompt + new tokens), default the model's max_positions.
        nbits_accuracy: a quantized artifact's MatMulNBits/QMoE level, 0 (float, what compare
        checks) as everywhere in the library; serve passes its --accuracy-level, by default
        runtime/quantized.RUN_ACCURACY.
        Raises LoweringError when the artifact's attention cannot run on GroupQueryAttention."""
        self.artifact = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
        if self.artifact.kind != "decoder":
            raise ValueError(f"{self.artifact.path} holds a {self.artifact.kind!r}, not a decoder artifact")
        self.config = DecoderConfig.from_manifest(self.artifact.manifest["config"])
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.capacity = min(capacity or self.config.max_positions, self.config.max_positions)
        self.vocab_size = self.config.vocab_size
        self.lowered = create_session(self.artifact, providers, moe_lowering, threads, attention_lowering="gqa",
                                      logits="last", kv_cache="ragged", nbits_accuracy=nbits_accuracy)
        if self.lowered.lowering.get("attention_gqa", 0) != self.config.n_layers:
            raise LoweringError("in-flight batching needs every layer's attention on GroupQueryAttention "
                                f"({self.lowered.lowering.get('attention_gqa', 0)} of {self.config.n_layers} are)")
        self.names = past_names(self.config.n_layers)
        dtype = NP_DTYPES[self.artifact.dtype]
        # the second half of each row: room for a padded chunk, never read (see the module's doc)
        shapes = past_shapes(self.config, slots, 2 * self.capacity) * self.config.n_layers
        self.buffers = [np.zeros(shape, dtype=dtype) for shape in shapes]
        self._binding = self.lowered.session.io_binding()
        self._bound: tuple[int, int] | None = None  # the rows the cache views are bound to

    @property
    def bytes_per_row(self) -> int:
        return sum(b[0].nbytes for b in self.buffers)

    def _bind_rows(self, first: int, count: int) -> None:
        if first < 0 or first + count > self.slots:
            raise ValueError(f"rows {first}..{first + count - 1} are outside the cache's {self.slots} rows")
        if self._bound == (first, count):
            return
        binding = self._binding
        binding.bind_output("logits")  # first, so it is get_outputs()[0] (rebinding keeps its place)
        for name, buffer in zip(self.names, self.buffers, strict=True):
            view = ort.OrtValue.ortvalue_from_numpy(buffer[first:first + count])  # the rows themselves, no copy
            binding.bind_ortvalue_input(name, view)
            binding.bind_ortvalue_output("present." + name.removeprefix("past_key_values."), view)
        self._bound = (first, count)

    def step(self, first: int, chunks: list[np.ndarray], lengths: np.ndarray) -> np.ndarray:
        """chunks[i] (its own length >= 1) into row first+i, which holds lengths[i] positions
        -> (len(chunks), V): each row's logits after its last token."""
        counts = np.array([len(c) for c in chunks], dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if counts.size == 0 or counts.min() < 1 or lengths.shape != counts.shape:
            raise ValueError("a step takes one chunk of at least one token and one length per row")
        if int((lengths + counts).max()) > self.capacity:
            raise ValueError(f"{int((lengths + counts).max())} positions exceed a row's capacity of {self.capacity}")
        padded, slots = ragged_indices(counts)
        self._bind_rows(first, len(chunks))
        binding = self._binding
        binding.bind_output("logits")  # unallocated again: its shape follows the step's rows
        binding.bind_cpu_input("input_ids", np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks])[None])
        binding.bind_cpu_input(PAST_LENGTHS, lengths)
        binding.bind_cpu_input(QUERY_LENGTHS, counts)
        binding.bind_cpu_input(PADDED_TOKENS, padded)
        binding.bind_cpu_input(TOKEN_SLOTS, slots)
        self.lowered.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]

    def prefill(self, first: int, ids: np.ndarray) -> np.ndarray:
        """Prompts of one length, (k, S), into rows first..first+k-1 from an empty past -> (k, V)."""
        return self.step(first, list(np.asarray(ids)), np.zeros(len(ids), dtype=np.int64))

    def decode(self, first: int, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """One token per row, (n,), into rows first..first+n-1 holding lengths (n,) -> (n, V)."""
        return self.step(first, list(np.asarray(tokens).reshape(-1, 1)), np.asarray(lengths))

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row src's first `length` positions into row dst (every layer's key and value)."""
        for buffer in self.buffers:
            buffer[dst, :, :length] = buffer[src, :, :length]
