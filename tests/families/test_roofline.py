"""The decode roofline counts what a family's step reads: dense layers, shared experts and
sliding windows change the bytes per token (hand counts)."""

from __future__ import annotations

from moedeploy.bench.roofline import decode_step_bytes, decode_step_flops
from moedeploy.models import DecoderConfig


def test_dense_layer_shared_expert_and_window_by_hand() -> None:
    c = DecoderConfig(vocab_size=100, hidden_size=8, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, top_k=2,
                      expert_hidden=6, dense_layers=[0], dense_hidden=10, shared_expert_hidden=5,
                      shared_expert_gate=True, sliding_window=3, sliding_layers=[1])
    attention = 8 * 8 * 2 + 8 * 4 * 2  # q, o: 8x8; k, v: 8x4 (one KV head of 4)
    dense = 3 * 8 * 10
    moe = 8 * 4 + 2 * 3 * 8 * 6 + 3 * 8 * 5 + 8  # router, 2 experts, shared expert, its gate
    norms = 2 * 8
    weights = 2 * attention + dense + moe + 2 * norms + 8 * 100 + 8 * 2
    kv = 2 * 1 * 4 * 10 + 2 * 1 * 4 * 3  # layer 0 reads 10 positions, layer 1 its window of 3
    assert decode_step_bytes(c, batch=1, context=10) == 4 * (weights + kv)
    matmuls = 2 * attention + dense + moe + 8 * 100
    scores = 2 * 2 * 4 * 10 + 2 * 2 * 4 * 3
    assert decode_step_flops(c, batch=1, context=10) == 2 * (matmuls + scores)
