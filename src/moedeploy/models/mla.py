"""Multi-head latent attention (DeepSeek-V2/V3) with a cache of compressed latents.

Every token's keys and values are made from one small vector, the latent c = norm(W_kv_a x)
(kv_lora_rank wide), plus one rotary key k_r that all heads share (rotary_dim wide). Per head:

    k_h = [W_uk,h c ; k_r]        v_h = W_uv,h c

so the cache only needs c and k_r: kv_lora_rank + rotary_dim values per token and layer, not
2 x heads x head_dim. Attention is computed on the latents directly, with the up-projections
absorbed into the query and output sides (as vLLM and SGLang decode):

    q_h . k_h = (W_uk,h^T q_nope,h) . c + q_rot,h . k_r        (the query moves into latent space)
    sum_t p_t v_h,t = W_uv,h (sum_t p_t c_t)                     (attend over c, then project up)

which is ordinary multi-query attention over keys [c ; k_r] and values c, followed by one
small matmul per head. Hugging Face's DeepSeek modules expand c into per-head keys and values
instead; the two forms are the same maths (tests compare them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moedeploy.models.attention import LayerCache, apply_rotary
from moedeploy.models.norms import RMSNorm

#: DeepSeek's q_a_layernorm and kv_a_layernorm keep the RMSNorm default, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """DeepSeek's MLA: low-rank (optionally) queries, keys and values from a cached latent.

    w_uk (heads, qk_nope_head_dim, kv_lora_rank) and w_uv (heads, v_head_dim, kv_lora_rank)
    are the two halves of Hugging Face's kv_b_proj, per head.
    """

    def __init__(
        self, dim: int, n_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, rope_dim: int, v_head_dim: int,
        q_lora_rank: int = 0, scale: float | None = None, bias: bool = False, rope_interleaved: bool = True,
    ) -> None:
        super().__init__()
        self.n_heads, self.kv_lora_rank, self.rope_dim = n_heads, kv_lora_rank, rope_dim
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim
        qk_head_dim = qk_nope_head_dim + rope_dim
        self.scale = scale or qk_head_dim**-0.5
        self.rope_interleaved = rope_interleaved
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, n_heads * qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + rope_dim, bias=bias)
        self.kv_norm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.w_uk = nn.Parameter(torch.empty(n_heads, qk_nope_head_dim, kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(n_heads, v_head_dim, kv_lora_rank))
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=bias)
        bound = kv_lora_rank**-0.5  # nn.Linear's default init for kv_b_proj
        nn.init.uniform_(self.w_uk, -bound, bound)
        nn.init.uniform_(self.w_uv, -bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
        start_pos: int | torch.SymInt = 0,
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(B, S, self.n_heads, -1).transpose(1, 2)  # (B, nh, S, nope + rope)
        q_nope, q_rot = q.split([self.qk_nope_head_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_norm(latent)[:, None], k_rot[:, None]  # (B, 1, S, r), (B, 1, S, rope)
        if rope is not None:
            cos, sin = rope
            q_rot = apply_rotary(q_rot, cos, sin, self.rope_interleaved)
            k_rot = apply_rotary(k_rot, cos, sin, self.rope_interleaved)
        if cache is not None:
            latent, k_rot = cache.update(start_pos, latent, k_rot)  # (B, 1, T, r), (B, 1, T, rope)
        query = torch.cat((q_nope @ self.w_uk, q_rot), dim=-1)  # (B, nh, S, r + rope): W_uk^T q_nope
        key = torch.cat((latent, k_rot), dim=-1)  # (B, 1, T, r + rope), shared by every head
        out = F.scaled_dot_product_attention(query, key, latent, attn_mask=mask, scale=self.scale, enable_gqa=True)
        out = out @ self.w_uv.transpose(1, 2)  # (B, nh, S, r) -> (B, nh, S, v): W_uv (sum_t p_t c_t)
        return self.wo(out.transpose(1, 2).reshape(B, S, self.n_heads * self.v_head_dim))
