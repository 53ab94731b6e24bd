"""DFlash drafters for `AutoModel.from_pretrained(folder, trust_remote_code=True)`: copied into every export.

dflash writes this file as `modeling_dflash.py` beside `config.json` (whose `auto_map` names `DFlashDraftModel`,
`DFlash2DraftModel` for a DFlash 2 drafter or `Qwen3DSparkModel` for a DSpark one) and never imports it itself. It must stay self-contained, depending on torch and transformers only: transformers
loads it from the exported folder on machines where dflash is not installed, so it cannot import `dflash`. It
repeats the forward of `dflash.drafter.model.DFlashDrafter`, `dflash.methods.dflash2.DFlash2Drafter` and
`dflash.methods.dspark.DSparkDrafter` (inference form:
no mask, or a dense boolean one) with the same parameter names; tests compare them so that they cannot drift apart.

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
    _no_split_modules = ["DFlashLayer", "DFlash2Layer"]
    # The target's own, in an export made for DeepSpec's evaluator (`dflash export --with-target-embeddings`):
    # applied from the target outside this model, as without them
    _keys_to_ignore_on_load_unexpected = [r"^embed_tokens\.weight$", r"^lm_head\.weight$"]
    layer_cls = DFlashLayer

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
        self.layers = nn.ModuleList(self.layer_cls(config) for _ in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.add_method_modules(config)
        self.post_init()

    def add_method_modules(self, config):
        """DFlash has none; DFlash 2 adds its candidate selector, DSpark its Markov and confidence heads."""

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)
        elif isinstance(module, DFlash2Conv):
            module.reset_to_identity()  # after its projection's normal init: children are initialised first
        elif isinstance(module, DFlash2CandidateSelector):
            module.predecessor_codebook.data.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
            module.successor_codebook.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(0.0, getattr(self.config, "initializer_range", 0.02))

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


# ---- DFlash 2: a grouped dynamic causal conv around attention and MLP, a candidate selector over the LM head's top K


class DFlash2Conv(nn.Module):
    """y_t = sum_{o<K} (base[side][o] + d[t, side, o, c // G]) * x_{t-o}, taps never crossing a block."""

    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        self.taps = int(_dflash_field(config, "conv_kernel_size"))
        self.group_size = int(_dflash_field(config, "conv_group_size"))
        self.block_size = int(_dflash_field(config, "block_size", 16))
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, H))
        self.kernel_projection = nn.Linear(H, 2 * self.taps * (H // self.group_size), bias=False)
        self.reset_to_identity()

    def reset_to_identity(self):
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def convolve(self, x, side, dynamic):
        R, Q, H = x.shape
        B = self.block_size
        blocks = x.view(R, Q // B, B, H)
        kernel = self.base_kernel[side] + dynamic.repeat_interleave(self.group_size, dim=-1)
        kernel = kernel.view(R, Q // B, B, self.taps, H).to(x.dtype)
        out = blocks * kernel[..., 0, :]
        for o in range(1, self.taps):
            out = out + F.pad(blocks[:, :, : B - o], (0, 0, o, 0)) * kernel[..., o, :]
        return out.view(R, Q, H)

    def dynamic(self, x):
        R, Q, H = x.shape
        return self.kernel_projection(x).view(R, Q, 2, self.taps, H // self.group_size)


class DFlash2Layer(DFlashLayer):
    def __init__(self, config):
        super().__init__(config)
        self.attention_conv = DFlash2Conv(config)
        self.mlp_conv = DFlash2Conv(config)

    def forward(self, x, ctx, q_rope, kv_rope, mask):
        h = self.input_layernorm(x)
        d = self.attention_conv.dynamic(h)
        a = self.self_attn(self.attention_conv.convolve(h, 0, d[:, :, 0]), ctx, q_rope, kv_rope, mask)
        x = x + self.attention_conv.convolve(a, 1, d[:, :, 1])
        h = self.post_attention_layernorm(x)
        d = self.mlp_conv.dynamic(h)
        m = self.mlp(self.mlp_conv.convolve(h, 0, d[:, :, 0]))
        return x + self.mlp_conv.convolve(m, 1, d[:, :, 1])


class DFlash2CandidateSelector(nn.Module):
    def __init__(self, config):
        super().__init__()
        rank = int(_dflash_field(config, "selector_rank"))
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def edge_scores(self, hidden, unary, previous, candidates):
        """S [N, K] = unary [N, K] + <A[previous] * (P hidden), B[candidates]>: hidden [N, H], previous [N]."""
        gate = self.predecessor_codebook[previous] * self.hidden_projection(hidden)
        return unary + (gate[:, None, :] * self.successor_codebook[candidates]).sum(-1).to(unary.dtype)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2: `forward` as DFlash's (the input embeddings scaled by input_embedding_scale); the drafts of a block
    come from `unary_logits` and the selector's `edge_scores`, walked left to right from the anchor token."""

    layer_cls = DFlash2Layer

    def add_method_modules(self, config):
        self.candidate_selector = DFlash2CandidateSelector(config)
        self.input_embedding_scale = float(_dflash_field(config, "input_embedding_scale", 1.0))
        self.output_multiplier = float(_dflash_field(config, "output_multiplier", 1.0))
        cap = _dflash_field(config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None

    def forward(self, block_embeds, features, q_positions, ctx_positions, attention_mask=None):
        embeds = block_embeds * self.input_embedding_scale
        return super().forward(embeds, features, q_positions, ctx_positions, attention_mask)

    def unary_logits(self, hidden, lm_head_weight):
        logits = (hidden * self.output_multiplier) @ lm_head_weight.T.to(hidden.dtype)
        if self.final_logit_softcapping:
            logits = self.final_logit_softcapping * torch.tanh(logits / self.final_logit_softcapping)
        return logits


# ---- DSpark: the anchor slot drafts too; a Markov head over the previous token and a confidence head


class DSparkMarkovHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.markov_w1 = nn.Embedding(config.vocab_size, int(config.markov_rank))
        self.markov_w2 = nn.Linear(int(config.markov_rank), config.vocab_size, bias=False)


class DSparkConfidenceHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.with_markov = bool(getattr(config, "confidence_head_with_markov", True))
        width = config.hidden_size + int(config.markov_rank) * self.with_markov
        self.proj = nn.Linear(width, 1)


class Qwen3DSparkModel(DFlashDraftModel):
    """DSpark: `forward` as DFlash's over the block [anchor, mask x (B-1)], whose slot j drafts the token after
    position a + j (the anchor slot drafts too). `markov_logits` gives slot j's logits after its previous token
    (the anchor for j = 0, else the token drafted at j - 1), `confidence_logits` its acceptance logit."""

    def add_method_modules(self, config):
        self.markov_head = DSparkMarkovHead(config)
        self.confidence_head = (
            DSparkConfidenceHead(config) if getattr(config, "enable_confidence_head", False) else None
        )

    def markov_logits(self, hidden, previous, lm_head_weight):
        """hidden [..., H], previous [...] token ids -> [..., V]: lm_head(h) + W2 W1[previous]."""
        unary = hidden @ lm_head_weight.T.to(hidden.dtype)
        return unary + self.markov_head.markov_w2(self.markov_head.markov_w1(previous)).to(unary.dtype)

    def confidence_logits(self, hidden, previous):
        e = self.markov_head.markov_w1(previous).to(hidden.dtype)
        features = torch.cat([hidden, e], dim=-1) if self.confidence_head.with_markov else hidden
        proj = self.confidence_head.proj
        acc = _acc(features.dtype)
        return (features.to(acc) * proj.weight[0].to(acc)).sum(-1) + proj.bias.to(acc)
