"""DFlash drafter for `AutoModel.from_pretrained(folder, trust_remote_code=True)`: copied into every export.

dflash writes this file as `modeling_dflash.py` beside `config.json` (whose `auto_map` names `DFlashDraftModel`)
and never imports it itself. It must stay self-contained, depending on torch and transformers only: transformers
loads it from the exported folder on machines where dflash is not installed, so it cannot import `dflash`. It
repeats the forward of `dflash.drafter.DFlashDrafter` (inference form: no mask, or a dense boolean one) with the
same parameter names; tests/test_export.py compares the two so that they cannot drift apart.

    ctx = hidden_norm(fc(concat of n target layers))               # the fused target context
    per layer: K, V = [k/v_proj(ctx) ; k/v_proj(x)], Q = q_proj(x)  # queries only from the block tokens
    out = norm(x)                                                    # the target's LM head is applied outside
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


def _acc(dtype):
    return torch.promote_types(dtype, torch.float32)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.to(_acc(x.dtype))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(x32.dtype)).to(x.dtype)


def _rope(positions, head_dim, theta, dtype):
    acc = _acc(dtype)
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=acc) / head_dim)
    angles = positions.to(acc)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.to(cos.dtype) * cos[:, None] + rotated.to(cos.dtype) * sin[:, None]).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, ctx, q_rope, kv_rope, mask):
        R, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(R, Q, self.heads, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1).view(R, -1, self.kv_heads, self.head_dim)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1).view(R, -1, self.kv_heads, self.head_dim)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        q, k = _apply_rope(q, *q_rope), _apply_rope(k, *kv_rope)
        gqa = self.kv_heads != self.heads
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x, ctx, q_rope, kv_rope, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_rope, kv_rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _dflash_field(config, name, default=None):
    nested = getattr(config, "dflash_config", None) or {}
    return nested.get(name, getattr(config, name, default))


class DFlashDraftModel(PreTrainedModel):
    """The drafter: no embedding and no LM head (both are the target's); `forward` returns final-normed states."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config):
        super().__init__(config)
        self.target_layer_ids = [int(i) for i in _dflash_field(config, "target_layer_ids")]
        self.mask_token_id = int(_dflash_field(config, "mask_token_id"))
        self.block_size = int(_dflash_field(config, "block_size", 16))
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params = getattr(config, "rope_parameters", None) or {}
        self.rope_theta = float(params.get("rope_theta") or config.rope_theta)
        width = len(self.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, block_embeds, features, q_positions, ctx_positions, attention_mask=None):
        """Final-normed hidden states [R, Q, H] of the block tokens.

        block_embeds [R, Q, H]: the target's embeddings of [anchor token, mask token x (B-1)]; features [R, T, n*H]:
        the target's hidden states at `target_layer_ids`, concatenated; q_positions [R, Q], ctx_positions [R, T]:
        absolute positions; attention_mask: None (every block token sees the whole context and block) or a boolean
        [R, 1, Q, T + Q] (True = visible). Apply the target's LM head to the result for logits.
        """
        ctx = self.hidden_norm(self.fc(features))
        q_rope = _rope(q_positions, self.head_dim, self.rope_theta, block_embeds.dtype)
        ctx_rope = _rope(ctx_positions, self.head_dim, self.rope_theta, block_embeds.dtype)
        kv_rope = tuple(torch.cat([c, q], dim=1) for c, q in zip(ctx_rope, q_rope))
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, q_rope, kv_rope, attention_mask)
        return self.norm(x)
