"""The DFlash drafter: a few Qwen3-style layers whose keys and values also see the target's fused hidden states.

Layout and checkpoint names follow the public DFlash checkpoints (see ../shared/DFLASH.md), so an exported
drafter loads in the public inference code and in SGLang / vLLM:

    ctx = hidden_norm(fc(concat of n target layers))               # once per forward, never updated
    per layer: K, V = [k/v_proj(ctx) ; k/v_proj(x)], Q = q_proj(x)  # queries only from block tokens
    out = norm(x)                                                    # the target's LM head is applied outside

The drafter has no embedding and no LM head: both are the target's, frozen, and live with the caller.
"""

from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from dflash.config import RECOMPUTE
from dflash.drafter.attention import check_kernel_options, uses_flash
from dflash.errors import DflashError

INIT_STD = 0.02  # Qwen3's initializer_range; the public drafters were initialised the same way
# `--recompute pointwise`: the ops whose outputs a layer keeps for its backward, its matmuls and its attention. The
# rest (norms, RoPE, the SwiGLU product, DFlash 2's convs, autocast's bf16 weight copies) runs again in the backward
# from those: memory traffic, no matmul. The attention ops are every backend's, the CPU's included.
KEPT_BY_POINTWISE = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.higher_order.flex_attention,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
)


def _keep_matmul_outputs():
    return create_selective_checkpoint_contexts(list(KEPT_BY_POINTWISE))


@dataclass(kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int = 5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    vocab_size: int
    block_size: int = 16
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int | None = None
    # Attention over the context limited to the last `sliding_window` positions before each block token (None: all).
    sliding_window: int | None = None
    # The target trained for, as TargetIdentity.to_record() (config.json's `dflash_target`): eval compares it with
    # --model, which the config's shape alone cannot tell from a fine-tune. None: a drafter exported before it.
    target_identity: dict | None = None

    method: ClassVar[str] = "dflash"  # the key of dflash.methods.METHODS
    architecture: ClassVar[str] = "DFlashDraftModel"  # config.json's `architectures`, what the engines dispatch on
    # Whether the anchor's own block slot drafts (DSpark): slot j then predicts the token after position a + j.
    # Otherwise (DFlash) slot 0 only holds the anchor token and slot k >= 1 predicts the token at a + k.
    anchor_predicts: ClassVar[bool] = False

    def __post_init__(self):
        # A query sees the window - 1 positions before its own: the anchor's slot sees none of the context below 2.
        if self.sliding_window is not None and self.sliding_window < 2:
            raise DflashError(
                f"sliding_window {self.sliding_window} leaves a block no context; give a window of at least 2 tokens "
                "with --drafter-option sliding_window=N, or sliding_window=none for the whole context"
            )
        # dflash lets a block's tokens see each other whatever the window; z-lab's reference hides those the window
        # or more apart too, so below the block size the two would draft differently (issue 53).
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise DflashError(
                f"sliding_window {self.sliding_window} is below block_size {self.block_size}: z-lab's reference "
                "would hide a block's own tokens from each other, which training does not; give "
                f"--drafter-option sliding_window={self.block_size} or more (or sliding_window=none), or a smaller "
                "--block-size"
            )

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - 1 + self.anchor_predicts

    @property
    def span(self) -> int:
        """Tokens from a block's anchor to its last draft: the trainer's labels, weights and stats per block."""
        return self.drafts_per_block + 1

    @property
    def feature_dim(self) -> int:
        """Width of the concatenated target features that `fc` fuses."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_target_config(cls, hf_config, target_layer_ids, mask_token_id, num_layers=5, **overrides):
        """Shape a drafter like the target: same width, heads, FFN, RoPE theta and vocabulary."""
        text = _get(hf_config, "text_config", None) or hf_config  # multimodal configs nest the LM's
        hidden = _get(text, "hidden_size")
        heads = _get(text, "num_attention_heads")
        # MoE targets have no dense FFN width; the public Qwen3.5-MoE drafters use 3 x hidden.
        ffn = _get(text, "intermediate_size", None) or 3 * hidden
        fields = dict(
            hidden_size=hidden,
            intermediate_size=ffn,
            num_attention_heads=heads,
            num_key_value_heads=_get(text, "num_key_value_heads", None) or heads,
            head_dim=_get(text, "head_dim", None) or hidden // heads,
            num_layers=num_layers,
            rms_norm_eps=_get(text, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta_of(text),
            max_position_embeddings=_get(text, "max_position_embeddings"),
            vocab_size=_get(text, "vocab_size"),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in target_layer_ids],
            num_target_layers=_get(text, "num_hidden_layers"),
        )
        check_overrides(cls, overrides)
        if "head_dim" in overrides and not {"num_attention_heads", "num_key_value_heads"} & set(overrides):
            fields.update(heads_at_head_dim(fields, overrides["head_dim"]))
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self, dtype: torch.dtype | None = None) -> dict:
        """The `config.json` of a public DFlash checkpoint: a Qwen3 config plus the DFlash fields."""
        dflash = {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id}
        config = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_layers,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # transformers 5 reads rope_parameters, 4.x and several serving stacks read rope_theta.
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": [self.layer_type] * self.num_layers,
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "initializer_range": INIT_STD,
            # The block is bidirectional in every method and layer type. The engines and z-lab's class make
            # sliding_attention layers causal unless told (vLLM: is_causal decides every layer when set).
            "is_causal": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            # Some loaders read block_size from dflash_config, others from the top level: write both.
            "dflash_config": {**dflash, "block_size": self.block_size},
        }
        if self.target_identity is not None:  # engines ignore the key
            config["dflash_target"] = self.target_identity
        if dtype is not None:
            name = str(dtype).removeprefix("torch.")
            config["dtype"] = config["torch_dtype"] = name  # transformers 5 name and the 4.x one
        return config

    @property
    def layer_type(self) -> str:
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def checkpoint_keys(self) -> list[str]:
        """The tensor names of a public checkpoint of this config, sorted."""
        per_layer = [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
            *self.extra_layer_keys(),
        ]
        layers = [f"layers.{i}.{name}" for i in range(self.num_layers) for name in per_layer]
        return sorted(["fc.weight", "hidden_norm.weight", "norm.weight", *layers, *self.extra_keys()])

    def method_flops_per_token(self) -> float:
        """Forward matmul FLOPs per block token of a method's modules beyond DFlash's
        (dflash.drafter.flops.step_flops)."""
        return 0.0

    def loss_logit_copies(self, teacher: str | None) -> float:
        """fp32 [loss chunk x V] logits a method's loss keeps at its peak on a GPU, with the store's teacher kind
        (`hidden`, `topk` or None; dflash.drafter.memory.step_memory): DFlash's chunked CE keeps one."""
        return 1.0

    def method_activation_copies(self, recompute: str = "none") -> float:
        """Activations a method's modules keep per drafter layer and block token beyond DFlash's, in copies of the
        hidden width, on a GPU (dflash.drafter.memory.step_memory), under TrainConfig.recompute `recompute`."""
        return 0.0

    def extra_layer_keys(self) -> list[str]:
        """A method's tensors in every layer, beyond DFlash's (names under layers.{i}.)."""
        return []

    def extra_keys(self) -> list[str]:
        """A method's tensors outside the layers, beyond DFlash's."""
        return []

    @classmethod
    def from_hf_config(cls, config: dict) -> "DrafterConfig":
        """Inverse of `to_hf_config`; also reads public checkpoints that keep DFlash fields at the top level."""
        dflash = config.get("dflash_config") or {}

        def dflash_field(name, default=None):
            return dflash.get(name, config.get(name, default))

        if dflash_field("target_layer_ids") is None or dflash_field("mask_token_id") is None:
            raise DflashError(
                "the drafter config.json has no dflash_config.target_layer_ids / mask_token_id; "
                "point to a folder written by `dflash export` or a public DFlash checkpoint"
            )
        heads = config["num_attention_heads"]
        return cls(
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            num_layers=config["num_hidden_layers"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta_of(config),
            max_position_embeddings=config["max_position_embeddings"],
            vocab_size=config["vocab_size"],
            block_size=int(dflash_field("block_size", 16)),
            mask_token_id=int(dflash_field("mask_token_id")),
            target_layer_ids=[int(i) for i in dflash_field("target_layer_ids")],
            num_target_layers=config.get("num_target_layers"),
            sliding_window=sliding_window_of(config),
            target_identity=config.get("dflash_target"),
            **cls.extra_from_hf(dflash_field),
        )

    @classmethod
    def extra_from_hf(cls, dflash_field) -> dict:
        """A method's own fields, read from config.json by `dflash_field(name, default)` (dflash_config first)."""
        return {}


def sliding_window_of(config: dict) -> int | None:
    """The drafter's window: set when config.json says its layers slide (layer_types, or use_sliding_window)."""
    slides = "sliding_attention" in (config.get("layer_types") or []) or config.get("use_sliding_window")
    return int(config["sliding_window"]) if slides and config.get("sliding_window") else None


def heads_at_head_dim(fields: dict, head_dim: int) -> dict:
    """The heads and KV heads that keep the target's attention widths (heads x head_dim) at another head_dim: a
    drafter of the same size whose attention runs on other kernel tiles (flex_attention's at 128 run closer to the
    GPU's peak than at 256, docs/training.md)."""
    heads, kv_heads, old = fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]
    if head_dim < 1 or (heads * old) % head_dim or (kv_heads * old) % head_dim:
        raise DflashError(
            f"--drafter-option head_dim={head_dim} does not divide the target's attention widths ({heads} heads and "
            f"{kv_heads} KV heads of {old}: {heads * old} and {kv_heads * old}); give a head_dim that divides both, or "
            "set num_attention_heads and num_key_value_heads beside it"
        )
    return {"num_attention_heads": heads * old // head_dim, "num_key_value_heads": kv_heads * old // head_dim}


def check_overrides(config_cls: type, overrides: dict) -> None:
    """`--drafter-option KEY=VALUE` values: known fields of the method's config with values of their type."""
    import types
    import typing

    hints = typing.get_type_hints(config_cls)
    known = sorted(f.name for f in dataclass_fields(config_cls))
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise DflashError(
            f"unknown drafter config field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in --drafter-option; "
            f"the fields are {', '.join(known)}"
        )

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    for name, value in overrides.items():
        kind = hints[name]
        if isinstance(kind, types.UnionType):  # `int | None`
            if value is None:
                continue
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        if kind is int:
            ok, want = is_int(value), "an integer"
        elif kind is float:
            ok, want = is_int(value) or isinstance(value, float), "a number"
        elif typing.get_origin(kind) is list:
            ok, want = isinstance(value, list) and all(map(is_int, value)), "a list of integers"
        else:
            ok, want = True, ""
        if not ok:
            raise DflashError(f"--drafter-option {name}={value!r} is not {want}; give {want} for {name}")


def _get(config, name, *default):
    """Read a field from a transformers config object or a plain dict."""
    if isinstance(config, dict):
        return config[name] if not default else config.get(name, default[0])
    return getattr(config, name, *default)


def rope_theta_of(config) -> float:
    params = _get(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") or _get(config, "rope_theta", None)
    if theta is None:
        raise DflashError("the target config has no rope_theta (nor rope_parameters.rope_theta); pass rope_theta=")
    return float(theta)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for norms and RoPE: fp32 for bf16 / fp32 activations; fp64 stays fp64 (the tests' reference)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Statistics in fp32, result in the input's dtype so that bf16 activations stay bf16 under autocast.
        acc = acc_dtype(x.dtype)
        x32 = x.to(acc)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(acc)).to(x.dtype)


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos / sin [R, S, head_dim] at absolute positions, rebuilt per call: no buffer that .to(bf16) could round."""
    acc = acc_dtype(dtype)
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=acc) / head_dim)
    angles = positions.to(acc)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [R, heads, S, D]; the Qwen3 (non-interleaved, rotate-half) convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    out = x.to(cos.dtype) * cos[:, None] + rotated.to(cos.dtype) * sin[:, None]
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.kernel_options: dict | None = None  # flex_attention's; see DFlashDrafter.set_attention_kernel_options
        self.kv_repeat = 1  # K / V heads repeated before flex_attention (flash_kv_repeat)

    def forward(self, x: Tensor, ctx: Tensor, q_rope, kv_rope, mask: BlockMask | Tensor | None) -> Tensor:
        R, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(R, Q, self.heads, self.head_dim)).transpose(1, 2)
        # KV injection: the fused target context and the block tokens share the projections and k_norm.
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1).view(R, -1, self.kv_heads, self.head_dim)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1).view(R, -1, self.kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = apply_rope(q, *q_rope), apply_rope(k, *kv_rope)
        gqa = self.kv_heads != self.heads
        if isinstance(mask, BlockMask):
            if self.kv_repeat > 1:
                k, v = k.repeat_interleave(self.kv_repeat, dim=1), v.repeat_interleave(self.kv_repeat, dim=1)
            out = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=self.kernel_options)
        else:  # None: one block per row at inference, everything visible; or a dense mask (CPU training)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.heads * self.head_dim))


def flash_kv_repeat(heads: int, kv_heads: int, options: dict | None) -> int:
    """How many times each K / V head is repeated before flex_attention under these kernel options: 1 unless they
    pick the FLASH backend, whose forward took 3.9x Triton's time with 3 or 6 query heads per K / V head and 0.7x
    with 1 or 2 (H100, docs/benchmarks.md, "Long rows"); then the smallest repeat that leaves a power of two."""
    if not uses_flash(options):
        return 1
    group = heads // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and (group // r) & (group // r - 1) == 0)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.recompute = False  # see DFlashDrafter.set_recompute

    def forward(self, x: Tensor) -> Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self.swiglu, x, use_reentrant=False)
        return self.swiglu(x)

    def swiglu(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx, q_rope, kv_rope, mask):
        # ctx is not normed here: it was normed once by hidden_norm and is the same input to every layer.
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_rope, kv_rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    layer_cls: ClassVar[type[nn.Module]] = Layer  # a method's drafter may change the layers, not their interface

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.feature_dim, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_cls(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.recompute = "none"  # see set_recompute
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=INIT_STD)

    def set_attention_kernel_options(self, options: dict | None) -> None:
        """flex_attention's kernel options for every layer (tile sizes, warps, stages: FlexKernelOptions' keys, with
        a fwd_ / bwd_ prefix for one pass only). They change the speed, and the result only by float rounding."""
        check_kernel_options(options or {})
        for module in self.modules():
            if isinstance(module, Attention):
                module.kernel_options = dict(options) if options else None
                module.kv_repeat = flash_kv_repeat(module.heads, module.kv_heads, options)

    def set_recompute(self, mode: str) -> None:
        """What the backward recomputes (RECOMPUTE): memory for time, the values unchanged."""
        if mode not in RECOMPUTE:
            raise DflashError(f"--recompute {mode!r} is not one of {', '.join(RECOMPUTE)}")
        self.recompute = mode
        for module in self.modules():
            if isinstance(module, MLP):
                module.recompute = mode == "mlp"

    def forward(
        self,
        block_embeds: Tensor,
        features: Tensor,
        q_positions: Tensor,
        ctx_positions: Tensor,
        block_mask: BlockMask | Tensor | None = None,
    ) -> Tensor:
        """Final-normed hidden states [R, Q, H] of the block tokens.

        block_embeds [R, Q, H]: the target's embeddings of the block tokens ([anchor token, MASK x (B-1)] per block);
        features [R, T, n*H]: concatenated target layer outputs; q_positions [R, Q] / ctx_positions [R, T]: absolute
        positions (the target's); block_mask: the training BlockMask over KV = [context T ; block tokens Q]
        (see blocks.block_attention_mask); or None: every block token sees all context and all block tokens; or a
        dense mask [R, 1, Q, T + Q], bool (True = visible) or an additive bias (blocks.dense_attention_bias). The residual stream keeps
        block_embeds' dtype. Uncompiled, flex_attention is a slow reference: compile the drafter to train on GPU.
        """
        ctx = self.hidden_norm(self.fc(features))
        cfg = self.config
        q_rope = rope_tables(q_positions, cfg.head_dim, cfg.rope_theta, block_embeds.dtype)
        ctx_rope = rope_tables(ctx_positions, cfg.head_dim, cfg.rope_theta, block_embeds.dtype)
        kv_rope = tuple(torch.cat([c, q], dim=1) for c, q in zip(ctx_rope, q_rope))
        mask = block_mask
        if isinstance(block_mask, BlockMask) and features.device.type == "cpu":
            # On the CPU flex_attention has no backward and, uncompiled, materialises the scores anyway:
            # evaluate the same mask_mod densely, once, and use SDPA.
            R, (Q, KV) = features.shape[0], block_mask.seq_lengths
            mask = create_mask(block_mask.mask_mod, R, 1, Q, KV, device=features.device)
        x = block_embeds
        for layer in self.layers:
            x = self._run_layer(layer, x, ctx, q_rope, kv_rope, mask)
        return self.norm(x)

    def _run_layer(self, layer: nn.Module, *inputs) -> Tensor:
        if self.recompute != "pointwise" or not torch.is_grad_enabled():
            return layer(*inputs)
        return checkpoint(layer, *inputs, use_reentrant=False, context_fn=_keep_matmul_outputs)
