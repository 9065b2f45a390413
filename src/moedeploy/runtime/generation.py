"""Generation over the exported decoder (ONNX Runtime, TensorRT), with the eager `generate` API.

The loop and the sampling rules are the same code as eager PyTorch's
(`moedeploy.models.generation`), so the two produce identical tokens whenever their
logits agree; only `step` differs: it feeds the graph the KV cache it returned last time.
An ONNX Runtime session lowered with logits="greedy" also picks the greedy token in the
graph (`greedy_step`, the argmax torch.argmax takes), which greedy generation then reads.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from moedeploy.export.artifact import NP_DTYPES, Artifact
from moedeploy.export.decoder import past_names, past_shapes, present_names
from moedeploy.models.config import DecoderConfig
from moedeploy.models.generation import TokenIds, as_prompt, generate, greedy_argmax
from moedeploy.runtime.gqa import PAST_LENGTHS
from moedeploy.runtime.lowering import (
    NEXT_TOKEN,
    AttentionLowering,
    KVCache,
    LogitsLowering,
    MoELowering,
    NormLowering,
)
from moedeploy.runtime.ort import create_session


class KVDecoder:
    """A decoder artifact on some runtime: `step(ids, start_pos)`, `greedy_step(ids, start_pos)`
    and `generate(...)`.

    Subclasses only say how to run the graph once (`_run`: feed -> the logits, then the
    presents in the artifact's order); the cache bookkeeping and the generation loop are shared.
    """

    def __init__(self, artifact: Artifact | str) -> None:
        self.artifact = artifact if isinstance(artifact, Artifact) else Artifact.load(artifact)
        if self.artifact.kind != "decoder":
            raise ValueError(f"{self.artifact.path} holds a {self.artifact.kind!r}, not a decoder artifact")
        config = DecoderConfig.from_manifest(self.artifact.manifest["config"])
        self.n_layers = config.n_layers
        self.config = config
        self.max_positions = config.max_positions
        self.vocab_size = config.vocab_size
        self.np_dtype = NP_DTYPES[self.artifact.dtype]
        self.past_names = past_names(self.n_layers)
        self._past: list[np.ndarray] = []

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def reset(self, batch: int, capacity: int | None = None) -> None:
        """Empty KV cache (past length 0) for a new batch of prompts. `capacity`: the positions the
        generation will reach, for a runtime that preallocates its cache (the copying one grows)."""
        key, value = (np.zeros(shape, dtype=self.np_dtype) for shape in past_shapes(self.config, batch, 0))
        self._past = [key, value] * self.n_layers

    def step(self, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run `ids` (B, S) at positions start_pos..; keeps the returned cache. -> (B, S, V) logits."""
        logits, *present = self._run(self._feed(ids, start_pos))
        self._past = present
        return torch.from_numpy(logits)

    def _feed(self, ids: torch.Tensor, start_pos: int) -> dict[str, np.ndarray]:
        """The copying cache's inputs for a step at start_pos, once the position is checked."""
        if not self._past:
            raise ValueError("call reset(batch) before the first step")
        past_len = self._past[0].shape[2]
        if start_pos != past_len:
            raise ValueError(f"step at position {start_pos} but the cache holds {past_len} positions")
        return {"input_ids": ids.cpu().numpy().astype(np.int64), **dict(zip(self.past_names, self._past, strict=True))}

    def generate(
        self,
        input_ids: TokenIds,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Same arguments and result as MoEDecoder.generate: (B, S + new) token ids, or
        (S + new,) for a 1-D prompt; input_ids may be a torch tensor, NumPy array or list."""
        prompt = as_prompt(input_ids, self.vocab_size)
        # a preallocated cache holds what this generation reaches, not max_positions (which can be 128k)
        self.reset(prompt.ids.shape[0], min(prompt.ids.shape[1] + max(max_new_tokens, 0), self.max_positions))
        tokens = generate(self.step, prompt.ids, self.max_positions, max_new_tokens, temperature, top_k, top_p,
                          seed, eos_token_id, self.greedy_step if self.has_greedy_token else None)
        return prompt.result(tokens)

    @property
    def has_greedy_token(self) -> bool:
        """Whether the graph computes the greedy next token itself (`greedy_step`)."""
        return False

    def greedy_step(self, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run `ids` like `step`; -> (B,) the argmax of each row's last logits."""
        return greedy_argmax(self.step(ids, start_pos)[:, -1].float())


class OrtDecoder(KVDecoder):
    """The decoder on ONNX Runtime, with moe::MoE / moe::RMSNorm and attention lowered for the provider."""

    def __init__(
        self,
        artifact: Artifact | str,
        providers: list[str] | None = None,
        moe_lowering: MoELowering = "auto",
        threads: int | None = None,
        attention_lowering: AttentionLowering = "graph",
        logits: LogitsLowering = "all",
        norm_lowering: NormLowering = "native",
        kv_cache: KVCache = "copy",
        nbits_accuracy: int = 0,
        expert_pieces: int | None = None,
    ) -> None:
        """logits="last": `step` returns only the last position's logits, (B, 1, V), which is all
        that generation reads; the LM head then skips the prompt's other positions.
        logits="greedy": "last", and the graph takes their argmax too: `greedy_step` (and
        greedy `generate`) reads one token id a row, never the V-wide logits.
        norm_lowering="skip": residual Add + RMSNorm on SkipSimplifiedLayerNormalization.
        kv_cache="inplace" (with attention_lowering="gqa"): each layer's cache is one buffer of
        `capacity` positions, allocated by `reset` and bound as both past and present with ONNX
        Runtime's IO binding; GroupQueryAttention appends to it, so no step copies the cache.
        nbits_accuracy=4 (a quantized artifact): MatMulNBits with int8 activations, faster than
        the float computation of 0 at an accuracy cost benchmarks/README.md measures.
        expert_pieces: as `create_session`'s (by default the machine's MoE path, runtime/ort.py)."""
        super().__init__(artifact)
        self.kv_cache = kv_cache
        self.lowered = create_session(self.artifact, providers, moe_lowering, threads,
                                      attention_lowering=attention_lowering, logits=logits,
                                      norm_lowering=norm_lowering, kv_cache=kv_cache, nbits_accuracy=nbits_accuracy,
                                      expert_pieces=expert_pieces)
        self._binding: ort.IOBinding | None = None
        self._length = self._capacity = 0
        self._present_names = present_names(self.n_layers)
        self._greedy_token = bool(self.lowering.get("greedy_token"))  # read on every step

    @property
    def lowering(self) -> dict[str, int]:
        return self.lowered.lowering

    def reset(self, batch: int, capacity: int | None = None) -> None:
        """An empty cache for a new batch; in place, buffers for `capacity` positions (default
        the model's max_positions)."""
        if self.kv_cache == "copy":
            return super().reset(batch, capacity)
        # no step may run on the old binding once its buffers start to be replaced: it holds their addresses
        self._binding = None
        capacity = capacity or self.max_positions
        binding = self.lowered.session.io_binding()
        binding.bind_output("logits")  # first, so it is get_outputs()[0] (rebinding keeps its place)
        self._buffers = []
        shapes = past_shapes(self.config, batch, capacity) * self.n_layers
        for name, present, shape in zip(self.past_names, self._present_names, shapes, strict=True):
            buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=self.np_dtype))
            binding.bind_ortvalue_input(name, buffer)
            binding.bind_ortvalue_output(present, buffer)
            self._buffers.append(buffer)
        if self.has_greedy_token:  # the decoder's own buffers, alive as long as the binding that writes them
            self._token = np.zeros((batch, 1), dtype=np.int64)
            binding.bind_output(NEXT_TOKEN, "cpu", 0, np.int64, list(self._token.shape), self._token.ctypes.data)
            self._scratch = np.zeros((batch, 1, self.vocab_size), dtype=self.np_dtype)  # greedy steps' logits
        self._logits_to_scratch = False
        # a decode step's inputs, (B, 1) ids and (B,) past lengths: bound once, written in place each step
        self._one_token, self._past_lengths = np.zeros((batch, 1), np.int64), np.zeros(batch, np.int64)
        self._one_token_bound = False
        self._binding, self._length, self._capacity = binding, 0, capacity
        return None

    def step(self, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        if self.kv_cache == "copy":
            return super().step(ids, start_pos)
        binding = self._bind_step(ids, start_pos)
        # unallocated again: ONNX Runtime allocates them anew, their shape following the step's tokens,
        # and the array handed out (a view of them) is the caller's for good
        binding.bind_output("logits")
        self._logits_to_scratch = False
        self._run_bound(ids)
        return torch.from_numpy(binding.get_outputs()[0].numpy())

    @property
    def has_greedy_token(self) -> bool:
        return self._greedy_token

    def greedy_step(self, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """The graph's own argmax of each row's last logits (logits="greedy"), (B,) int64: a greedy
        decode step moves one id a row out of ONNX Runtime, not (B, V) logits, and takes no argmax
        in Python (on the `small` preset, decode 3.5% faster in fp32 and 5.8% in int4 in one-process
        A/B runs, benchmarks/README.md). Other lowerings: the argmax of `step`'s logits."""
        if not self.has_greedy_token:
            return super().greedy_step(ids, start_pos)
        if self.kv_cache == "copy":
            token, *self._past = self.lowered.run(self._feed(ids, start_pos), [NEXT_TOKEN, *self._present_names])
            return torch.from_numpy(token[:, -1])
        binding = self._bind_step(ids, start_pos)
        if not self._logits_to_scratch:  # else this run would write into the logits `step` last handed out
            binding.bind_output("logits", "cpu", 0, self.np_dtype, list(self._scratch.shape), self._scratch.ctypes.data)
            self._logits_to_scratch = True
        self._run_bound(ids)
        return torch.from_numpy(self._token[:, -1].copy())  # the buffer is the next step's too

    def _bind_step(self, ids: torch.Tensor, start_pos: int) -> ort.IOBinding:
        """The in-place cache's binding with this step's inputs, once the positions are checked."""
        if self._binding is None:
            raise ValueError("call reset(batch) before the first step")
        if start_pos != self._length:
            raise ValueError(f"step at position {start_pos} but the cache holds {self._length} positions")
        if start_pos + ids.shape[1] > self._capacity:
            raise ValueError(f"{start_pos + ids.shape[1]} positions exceed the cache's capacity of {self._capacity}; "
                             "reset with a larger capacity")
        if ids.shape == self._one_token.shape:  # a decode step: into the buffers bound for it, no rebinding
            np.copyto(self._one_token, ids.cpu().numpy(), casting="unsafe")
            self._past_lengths.fill(start_pos)
            if not self._one_token_bound:
                for name, buffer in (("input_ids", self._one_token), (PAST_LENGTHS, self._past_lengths)):
                    self._binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(buffer))
                self._one_token_bound = True
        else:
            self._binding.bind_cpu_input("input_ids", ids.cpu().numpy().astype(np.int64))
            self._binding.bind_cpu_input(PAST_LENGTHS, np.full(ids.shape[0], start_pos, dtype=np.int64))
            self._one_token_bound = False
        return self._binding

    def _run_bound(self, ids: torch.Tensor) -> None:
        assert self._binding is not None
        self.lowered.session.run_with_iobinding(self._binding)
        self._length += ids.shape[1]

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.lowered.run(feed, ["logits", *self._present_names])


class TrtDecoder(KVDecoder):
    """The decoder on its TensorRT engine (Polygraphy's TrtRunner; needs TensorRT and a GPU)."""

    def __init__(self, artifact: Artifact | str) -> None:
        super().__init__(artifact)
        from moedeploy.runtime.tensorrt import trt_runner

        self.runner = trt_runner(self.artifact)
        self.runner.activate()
        self.output_names = self.artifact.output_names()

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs = self.runner.infer(feed)
        return [np.asarray(outputs[name]) for name in self.output_names]


class EagerDecoder(KVDecoder):
    """An eager PyTorch decoder (a DecoderWithPast: the graph's inputs and outputs) behind the
    same `step` and `generate` as the runtimes: so a measurement that sets eager beside a
    backend runs both through one loop (a layer-at-a-time checkpoint model included)."""

    def __init__(self, artifact: Artifact | str, module: torch.nn.Module) -> None:
        super().__init__(artifact)
        self.module = module

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        past = [torch.from_numpy(feed[name]) for name in self.past_names]
        with torch.no_grad():
            logits, present = self.module(torch.from_numpy(feed["input_ids"]), list(zip(past[::2], past[1::2], strict=True)))
        return [logits.numpy(), *(t.numpy() for pair in present for t in pair)]
