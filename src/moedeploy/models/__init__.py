"""Eager PyTorch reference models: the ground truth every exported graph and engine is judged by."""

from moedeploy.models.attention import Attention, RotaryEmbedding, StaticLayerCache, causal_mask
from moedeploy.models.checkpoint import CheckpointError, load_decoder, save_decoder
from moedeploy.models.config import PRESETS, DecoderConfig, preset
from moedeploy.models.decoder import MoEDecoder
from moedeploy.models.ffn import MLP, BatchNormMLP, FeedForward, SwiGLU, swiglu_hidden_dim
from moedeploy.models.generation import SamplingConfig, generate_tokens
from moedeploy.models.layers import DecoderLayer, EncoderLayer
from moedeploy.models.moe import SparseMoE
from moedeploy.models.norms import BatchNorm, LayerNorm, RMSNorm

__all__ = [
    "MLP",
    "PRESETS",
    "Attention",
    "BatchNorm",
    "BatchNormMLP",
    "CheckpointError",
    "DecoderConfig",
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "LayerNorm",
    "MoEDecoder",
    "RMSNorm",
    "RotaryEmbedding",
    "SamplingConfig",
    "SparseMoE",
    "StaticLayerCache",
    "SwiGLU",
    "causal_mask",
    "generate_tokens",
    "load_decoder",
    "preset",
    "save_decoder",
    "swiglu_hidden_dim",
]
