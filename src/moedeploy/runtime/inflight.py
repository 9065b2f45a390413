"""One KV cache of many rows on ONNX Runtime, for sequences that start and stop at different times.

In-flight (continuous) batching decodes every running sequence in one step although each
joined at its own time and so sits at its own position. The decoder's attention runs on
GroupQueryAttention with a shared-buffer cache (runtime/gqa.py), which takes each row's past
length as an input and rotates, writes and attends every row at its own positions. This
module owns the buffers: one per layer's key and value, `slots` rows of `capacity`
positions, preallocated (zero pages are only touched as rows fill). Rows 0..n-1 are the
running sequences, kept packed so that a step binds one contiguous view of them:

- `prefill(first_row, ids)` runs prompts of one length into rows first_row.. (a joining
  request, or several of one length together), each from an empty past;
- `decode(first_row, ids, lengths)` runs one token for each of the rows first_row.. at its
  own past length (a view of any run of rows, so a failing step can be retried row by row);
- `move(src, dst, length)` copies a row's cache into another, to close the gap a finished
  sequence leaves.

Views of numpy buffers are bound with IO binding: ONNX Runtime reads and writes the rows
where they lie, and no step copies the cache. Not thread-safe: one scheduler owns it.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from moedeploy.export.artifact import NP_DTYPES, Artifact
from moedeploy.export.decoder import past_names, past_shapes
from moedeploy.models.config import DecoderConfig
from moedeploy.runtime.gqa import PAST_LENGTHS
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
                                      logits="last", kv_cache="inplace", nbits_accuracy=nbits_accuracy)
        if self.lowered.lowering.get("attention_gqa", 0) != self.config.n_layers:
            raise LoweringError("in-flight batching needs every layer's attention on GroupQueryAttention "
                                f"({self.lowered.lowering.get('attention_gqa', 0)} of {self.config.n_layers} are)")
        self.names = past_names(self.config.n_layers)
        dtype = NP_DTYPES[self.artifact.dtype]
        shapes = past_shapes(self.config, slots, self.capacity) * self.config.n_layers
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

    def _run(self, first: int, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """ids (n, S) into rows first..first+n-1, each holding lengths[i] positions -> (n, V) logits."""
        if int(lengths.max()) + ids.shape[1] > self.capacity:
            raise ValueError(f"{int(lengths.max()) + ids.shape[1]} positions exceed a row's capacity of {self.capacity}")
        self._bind_rows(first, ids.shape[0])
        self._binding.bind_output("logits")  # unallocated again: its shape follows the step's rows
        self._binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
        self._binding.bind_cpu_input(PAST_LENGTHS, np.ascontiguousarray(lengths, dtype=np.int64))
        self.lowered.session.run_with_iobinding(self._binding)
        return self._binding.get_outputs()[0].numpy()[:, -1]

    def prefill(self, first: int, ids: np.ndarray) -> np.ndarray:
        """Prompts of one length, (k, S), into rows first..first+k-1 from an empty past -> (k, V)."""
        return self._run(first, ids, np.zeros(len(ids), dtype=np.int64))

    def decode(self, first: int, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """One token per row, (n,), into rows first..first+n-1 holding lengths (n,) -> (n, V)."""
        return self._run(first, np.asarray(tokens).reshape(-1, 1), np.asarray(lengths))

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row src's first `length` positions into row dst (every layer's key and value)."""
        for buffer in self.buffers:
            buffer[dst, :, :length] = buffer[src, :, :length]
