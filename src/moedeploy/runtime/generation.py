"""Generation over the exported decoder (ONNX Runtime, TensorRT), with the eager `generate` API.

The loop and the sampling rules are the same code as eager PyTorch's
(`moedeploy.models.generation`), so the two produce identical tokens whenever their
logits agree; only `step` differs: it feeds the graph the KV cache it returned last time.
"""

from __future__ import annotations

import numpy as np
import torch

from moedeploy.export.artifact import NP_DTYPES, Artifact
from moedeploy.export.decoder import past_names, past_shapes
from moedeploy.models.config import DecoderConfig
from moedeploy.models.generation import TokenIds, as_prompt, generate
from moedeploy.runtime.lowering import AttentionLowering, LogitsLowering, MoELowering, NormLowering
from moedeploy.runtime.ort import create_session


class KVDecoder:
    """A decoder artifact on some runtime: `step(ids, start_pos)` and `generate(...)`.

    Subclasses only say how to run the graph once (`_run`: feed -> outputs in the
    artifact's order); the cache bookkeeping and the generation loop are shared.
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

    def reset(self, batch: int) -> None:
        """Empty KV cache (past length 0) for a new batch of prompts."""
        key, value = (np.zeros(shape, dtype=self.np_dtype) for shape in past_shapes(self.config, batch, 0))
        self._past = [key, value] * self.n_layers

    def step(self, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run `ids` (B, S) at positions start_pos..; keeps the returned cache. -> (B, S, V) logits."""
        past_len = self._past[0].shape[2]
        if start_pos != past_len:
            raise ValueError(f"step at position {start_pos} but the cache holds {past_len} positions")
        feed = {"input_ids": ids.cpu().numpy().astype(np.int64), **dict(zip(self.past_names, self._past, strict=True))}
        logits, *present = self._run(feed)
        self._past = present
        return torch.from_numpy(logits)

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
        self.reset(prompt.ids.shape[0])
        tokens = generate(self.step, prompt.ids, self.max_positions, max_new_tokens, temperature, top_k, top_p,
                          seed, eos_token_id)
        return prompt.result(tokens)


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
    ) -> None:
        """logits="last": `step` returns only the last position's logits, (B, 1, V), which is all
        that generation reads; the LM head then skips the prompt's other positions.
        norm_lowering="skip": residual Add + RMSNorm on SkipSimplifiedLayerNormalization."""
        super().__init__(artifact)
        self.lowered = create_session(self.artifact, providers, moe_lowering, threads,
                                      attention_lowering=attention_lowering, logits=logits,
                                      norm_lowering=norm_lowering)

    @property
    def lowering(self) -> dict[str, int]:
        return self.lowered.lowering

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.lowered.run(feed)


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
