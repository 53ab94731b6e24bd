import json
import math

import pytest
import torch
import torch.nn.functional as F

from dflash.drafter import model as drafter_module
from dflash.drafter.blocks import block_attention_mask, dense_block_mask, sample_anchors
from dflash.drafter.model import DFlashDrafter, DrafterConfig, rope_tables
from dflash.drafter.proposers import FORWARD_SIGNATURES, context_width, window_mask
from dflash.errors import DflashError
from dflash.export import export_drafter, load_drafter
from dflash.tiny import tiny_config

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# The checkpoint names listed in ../shared/DFLASH.md, written out from the document.
DFLASH_MD_LAYER_KEYS = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]
DFLASH_MD_TOP_KEYS = ["norm.weight", "fc.weight", "hidden_norm.weight"]


def small_config(**overrides):
    fields = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_layers=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        vocab_size=50,
        block_size=4,
        mask_token_id=49,
        target_layer_ids=[1, 3, 5],
        num_target_layers=8,
    )
    fields.update(overrides)
    return DrafterConfig(**fields)


def make_drafter(cfg, seed=0):
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg).double()
    with torch.no_grad():  # norms start at 1: perturb them so that a missing or swapped norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def conv_reference(x, source, base, projection, side, block_size, group_size):
    """DFlash 2's tap formula as loops: y[t, c] = sum over o <= t mod B of (base[side, o, c] + d[t, side, o, c // G])
    * x[t - o, c], with d = projection(source) read as [Q, 2, K, H / G] (source: the prepare side's input)."""
    R, Q, H = x.shape
    K = base.shape[1]
    d = (source @ projection.T).view(R, Q, 2, K, H // group_size)
    group_of = torch.arange(H) // group_size
    out = torch.zeros_like(x)
    for t in range(Q):
        for o in range(K):
            if t % block_size >= o:
                out[:, t] += (base[side, o] + d[:, t, side, o][:, group_of]) * x[:, t - o]
    return out


def reference_drafter(params, cfg, embeds, features, q_pos, ctx_pos, visible):
    """A straightforward float64 DFlash drafter with explicit dense attention; visible [R, Q, T + Q] bool. With
    DFlash 2 tensors in `params`, its convs wrap attention and MLP (conv_reference) and the embeddings are scaled."""
    eps, D = cfg.rms_norm_eps, cfg.head_dim
    embeds = embeds * getattr(cfg, "input_embedding_scale", 1.0)

    def conv(p, name, x, source, side):
        if f"{name}.base_kernel" not in p:
            return x
        weights = p[f"{name}.base_kernel"], p[f"{name}.kernel_projection.weight"]
        return conv_reference(x, source, *weights, side, cfg.block_size, cfg.conv_group_size)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):  # x [R, S, heads, D]
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        angle = (pos.double()[..., None] * inv_freq)[:, :, None, :]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)

    R, Q, _ = embeds.shape
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    ctx = rms(features @ params["fc.weight"].T, params["hidden_norm.weight"])
    x = embeds
    for i in range(cfg.num_layers):
        p = {k.removeprefix(f"layers.{i}."): v for k, v in params.items() if k.startswith(f"layers.{i}.")}
        normed = rms(x, p["input_layernorm.weight"])
        h = conv(p, "attention_conv", normed, normed, 0)
        q = rms((h @ p["self_attn.q_proj.weight"].T).view(R, Q, -1, D), p["self_attn.q_norm.weight"])
        source = torch.cat([ctx, h], dim=1)  # keys and values: the fused context, then the block tokens
        k = rms((source @ p["self_attn.k_proj.weight"].T).view(R, source.shape[1], -1, D), p["self_attn.k_norm.weight"])
        v = (source @ p["self_attn.v_proj.weight"].T).view(R, source.shape[1], -1, D)
        q, k = rope(q, q_pos), rope(k, torch.cat([ctx_pos, q_pos], dim=1))
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = torch.einsum("rqhd,rkhd->rhqk", q, k) / math.sqrt(D)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        attn = torch.einsum("rhqk,rkhd->rqhd", scores.softmax(-1), v).reshape(R, Q, -1)
        x = x + conv(p, "attention_conv", attn @ p["self_attn.o_proj.weight"].T, normed, 1)
        normed = rms(x, p["post_attention_layernorm.weight"])
        h = conv(p, "mlp_conv", normed, normed, 0)
        mlp = F.silu(h @ p["mlp.gate_proj.weight"].T) * (h @ p["mlp.up_proj.weight"].T)
        x = x + conv(p, "mlp_conv", mlp @ p["mlp.down_proj.weight"].T, normed, 1)
    return rms(x, params["norm.weight"])


def training_batch(cfg, R=2, T=40, A=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.zeros(R, T, dtype=torch.int32)
    doc_ids[0, 17:] = 1
    doc_ids[1, 35:] = -1  # padding
    position_ids = torch.stack([torch.cat([torch.arange(17), torch.arange(T - 17)]), torch.arange(T)])
    loss_mask = torch.ones(R, T, dtype=torch.uint8)
    loss_mask[:, :3] = 0
    anchors, valid = sample_anchors(loss_mask, doc_ids, A, cfg.block_size, torch.tensor(seed))
    valid[1, -1] = False
    Q = A * cfg.block_size
    q_pos = (position_ids.gather(1, anchors)[:, :, None] + torch.arange(cfg.block_size)).view(R, Q)
    embeds = torch.randn(R, Q, cfg.hidden_size, generator=g, dtype=torch.float64)
    features = torch.randn(R, T, cfg.feature_dim, generator=g, dtype=torch.float64)
    return embeds, features, q_pos, position_ids, anchors, valid, doc_ids


# flex_attention; the CPU fallback under grad (the BlockMask's mask_mod, densely, with SDPA); a dense mask given
@pytest.mark.parametrize("mode", ["flex", "cpu-grad", "dense"])
def test_training_form_equals_reference(mode):
    cfg = small_config()
    model = make_drafter(cfg)
    embeds, features, q_pos, ctx_pos, anchors, valid, doc_ids = training_batch(cfg)
    visible = dense_block_mask(anchors, valid, doc_ids, cfg.block_size)
    mask = visible[:, None] if mode == "dense" else block_attention_mask(anchors, valid, doc_ids, cfg.block_size)
    with torch.set_grad_enabled(mode == "cpu-grad"):
        out = model(embeds, features, q_pos, ctx_pos, mask)
    params = {k: v.detach() for k, v in model.state_dict().items()}
    want = reference_drafter(params, cfg, embeds, features, q_pos, ctx_pos, visible)
    assert out.shape == embeds.shape
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def assert_inference_form_equals_training_form(model, cfg, s: int = 13):
    """One block after s context tokens, as decoding runs it (the context cut at the anchor, the proposer's mask),
    equals the training form (the whole row, one anchor at s, the BlockMask, the config's window)."""
    B, window = cfg.block_size, cfg.sliding_window
    g = torch.Generator().manual_seed(1)
    features = torch.randn(1, s + B, cfg.feature_dim, generator=g, dtype=torch.float64)
    embeds = torch.randn(1, B, cfg.hidden_size, generator=g, dtype=torch.float64)
    q_pos = torch.arange(s, s + B)[None]
    anchors, valid = torch.tensor([[s]]), torch.tensor([[True]])
    block_mask = block_attention_mask(anchors, valid, torch.zeros(1, s + B, dtype=torch.int32), B, window)
    trained = model(embeds, features, q_pos, torch.arange(s + B)[None], block_mask)
    inferred = model(embeds, features[:, :s], q_pos, torch.arange(s)[None], window_mask(s, B, window, "cpu"))
    torch.testing.assert_close(inferred, trained, rtol=1e-12, atol=1e-12)
    # graphed drafting's form: the context padded to its bucket; random padding rows, so the mask must hide them
    width = context_width(s, bucket=8)
    padding = torch.randn(1, width - s, cfg.feature_dim, generator=g, dtype=torch.float64)
    padded = torch.cat([features[:, :s], padding], dim=1)
    mask = window_mask(s, B, window, "cpu", width)
    graphed = model(embeds, padded, q_pos, torch.arange(width)[None], mask)
    torch.testing.assert_close(graphed, trained, rtol=1e-12, atol=1e-12)


# Windows that hide context (4 = B, the smallest a config takes: slot 0 sees three tokens, the last slot none), one
# that hides the first position from the last slot only (16 = s + B - 1) and one just past it (17: decoding passes
# no mask at all), with 13 context tokens and B = 4.
@pytest.mark.parametrize("window", [None, 4, 6, 16, 17])
def test_inference_form_equals_training_form_with_one_anchor_at_the_end(window):
    cfg = small_config(sliding_window=window)
    assert_inference_form_equals_training_form(make_drafter(cfg, seed=1), cfg)


def test_context_buckets_are_few_and_tight():
    """Graphed drafting's padded context: never shorter than the context, padded by less than an eighth of it past
    the smallest bucket, and few enough widths up to 2 M tokens for one graph each (FORWARD_SIGNATURES)."""
    widths = {}
    for context in [*range(5000), *range(5000, 1 << 21, 97), (1 << 21) - 1]:
        width = context_width(context)
        assert width >= max(context, 1) and width % 256 == 0
        assert width - context <= max(256, context / 8), context
        widths[width] = context
    assert len(widths) <= FORWARD_SIGNATURES
    assert context_width(0) == context_width(256) == 256 and context_width(257) == 512


def test_compiled_fullgraph_forward_and_backward_match_eager():
    cfg = small_config()
    model = make_drafter(cfg)
    embeds, features, q_pos, ctx_pos, anchors, valid, doc_ids = training_batch(cfg)
    block_mask = block_attention_mask(anchors, valid, doc_ids, cfg.block_size)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(embeds, features, q_pos, ctx_pos, block_mask)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(embeds, features, q_pos, ctx_pos, block_mask).square().sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-9, atol=1e-9, msg=n)


def gradients(model, cfg, compiled=False):
    embeds, features, q_pos, ctx_pos, anchors, valid, doc_ids = training_batch(cfg)
    dense = dense_block_mask(anchors, valid, doc_ids, cfg.block_size)[:, None]
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    model.zero_grad()
    run(embeds, features, q_pos, ctx_pos, dense).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mode", ["mlp", "pointwise"])
def test_recomputing_keeps_every_gradient(compiled, mode):
    """--recompute mlp runs each MLP again in the backward (non-reentrant checkpoint), --recompute pointwise each
    layer's element-wise work (selective checkpoint): the same gradients, eager and compiled; an unknown mode is
    refused."""
    cfg = small_config()
    model = make_drafter(cfg)
    kept = gradients(model, cfg)
    model.set_recompute(mode)
    assert model.recompute == mode and all(layer.mlp.recompute == (mode == "mlp") for layer in model.layers)
    recomputed = gradients(model, cfg, compiled)
    for name, grad in kept.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-12, atol=1e-12, msg=name)
    model.set_recompute("none")
    assert model.recompute == "none" and not any(layer.mlp.recompute for layer in model.layers)
    with pytest.raises(DflashError, match="--recompute 'layer' is not one of none, pointwise, mlp"):
        model.set_recompute("layer")


def test_export_load_round_trip(tmp_path):
    cfg = small_config()
    model = make_drafter(cfg)
    embeds, features, q_pos, ctx_pos, anchors, valid, doc_ids = training_batch(cfg)
    block_mask = block_attention_mask(anchors, valid, doc_ids, cfg.block_size)
    export_drafter(torch.compile(model), cfg, tmp_path)  # a compiled model exports its bare names

    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    want = {f"layers.{i}.{k}" for i in range(cfg.num_layers) for k in DFLASH_MD_LAYER_KEYS} | set(DFLASH_MD_TOP_KEYS)
    assert keys == want

    loaded, loaded_cfg = load_drafter(tmp_path, "cpu")
    assert loaded_cfg == cfg
    assert torch.equal(
        loaded(embeds, features, q_pos, ctx_pos, block_mask), model(embeds, features, q_pos, ctx_pos, block_mask)
    )
    assert all(p.requires_grad for p in loaded.parameters())  # can be trained further


def test_config_json_is_a_public_dflash_config(tmp_path):
    cfg = small_config()
    export_drafter(make_drafter(cfg).to(torch.bfloat16), cfg, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 4 and config["num_target_layers"] == 8
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert config["dflash_config"]["mask_token_id"] == 49
    assert config["num_hidden_layers"] == 2 and config["dtype"] == "bfloat16"

    from transformers import Qwen3Config  # the public loaders read it as a Qwen3 config

    qwen3 = Qwen3Config.from_dict(config)
    assert (qwen3.hidden_size, qwen3.intermediate_size, qwen3.head_dim) == (32, 48, 8)
    assert (qwen3.num_attention_heads, qwen3.num_key_value_heads, qwen3.num_hidden_layers) == (4, 2, 2)
    assert qwen3.rope_parameters["rope_theta"] == 10000.0 and qwen3.vocab_size == 50
    assert load_drafter(tmp_path, "cpu", torch.float32)[0].fc.weight.dtype == torch.float32


def test_load_reads_public_configs_with_top_level_fields():
    config = small_config().to_hf_config()
    dflash = config.pop("dflash_config")
    config.update(dflash)  # some public checkpoints keep the DFlash fields at the top level
    assert DrafterConfig.from_hf_config(config) == small_config()
    with pytest.raises(DflashError, match="target_layer_ids"):
        DrafterConfig.from_hf_config({k: v for k, v in config.items() if k != "target_layer_ids"})


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_5_moe", "llama"])
def test_from_target_config(arch):
    import transformers

    target = tiny_config(arch, vocab_size=300, num_layers=12, hidden_size=64)
    theta = target.rope_parameters["rope_theta"]
    if arch == "qwen3_5":  # the released checkpoints nest the language model's config
        target = transformers.Qwen3_5Config(text_config=target.to_dict())
    if arch == "qwen3_5_moe":  # a plain dict, and an MoE config without a dense FFN width
        target = {k: v for k, v in target.to_dict().items() if k != "intermediate_size"}
    cfg = DrafterConfig.from_target_config(target, [1, 5, 9], mask_token_id=299, num_layers=3, block_size=8)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.intermediate_size == (3 * 64 if arch == "qwen3_5_moe" else 128)
    assert cfg.rope_theta == theta
    assert (cfg.vocab_size, cfg.num_target_layers, cfg.num_layers, cfg.block_size) == (300, 12, 3, 8)
    assert cfg.feature_dim == 3 * 64 and cfg.target_layer_ids == [1, 5, 9]
    assert DrafterConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_drafter_options_name_unknown_fields_and_wrong_types():
    target = tiny_config("qwen3", vocab_size=300, num_layers=12, hidden_size=64)
    with pytest.raises(DflashError, match="unknown drafter config field foo in --drafter-option; the fields are .*"):
        DrafterConfig.from_target_config(target, [1, 5, 9], mask_token_id=299, foo=3)
    with pytest.raises(DflashError, match="intermediate_size='big' is not an integer"):
        DrafterConfig.from_target_config(target, [1, 5, 9], mask_token_id=299, intermediate_size="big")
    with pytest.raises(DflashError, match="rope_theta=True is not a number"):
        DrafterConfig.from_target_config(target, [1, 5, 9], mask_token_id=299, rope_theta=True)
    cfg = DrafterConfig.from_target_config(target, [1, 5, 9], 299, intermediate_size=96, rope_theta=5)
    assert (cfg.intermediate_size, cfg.rope_theta) == (96, 5)


def matmul_parameters(model) -> int:
    """Parameters outside the per-head q / k norms (whose weights are head_dim long)."""
    return sum(
        p.numel() for name, p in model.named_parameters() if not name.endswith(("q_norm.weight", "k_norm.weight"))
    )


def test_a_head_dim_option_keeps_the_attention_widths_and_the_parameter_count():
    target = tiny_config("qwen3", vocab_size=300, num_layers=12, hidden_size=64)  # 4 heads and 2 KV heads of 16
    base = DrafterConfig.from_target_config(target, [1, 5, 9], 299)
    for head_dim, heads, kv_heads in ((8, 8, 4), (32, 2, 1), (16, 4, 2)):
        cfg = DrafterConfig.from_target_config(target, [1, 5, 9], 299, head_dim=head_dim)
        assert (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == (head_dim, heads, kv_heads)
        assert matmul_parameters(make_drafter(cfg)) == matmul_parameters(make_drafter(base))
    explicit = DrafterConfig.from_target_config(target, [1, 5, 9], 299, head_dim=8, num_attention_heads=2)
    assert (explicit.num_attention_heads, explicit.num_key_value_heads) == (2, 2)  # given heads are taken as given
    with pytest.raises(DflashError, match="head_dim=64 does not divide the target's attention widths .* 64 and 32"):
        DrafterConfig.from_target_config(target, [1, 5, 9], 299, head_dim=64)


def test_attention_kernel_options_reach_flex_attention_in_every_layer(monkeypatch):
    cfg = small_config()
    model = make_drafter(cfg)
    options = {"bwd_num_warps": 8, "fwd_BLOCK_M": 32, "USE_TMA": True}
    model.set_attention_kernel_options(options)
    seen = []

    def spy(q, k, v, *, block_mask, enable_gqa, kernel_options):
        seen.append((block_mask, kernel_options))
        return q

    monkeypatch.setattr(drafter_module, "flex_attention", spy)
    embeds, features, q_pos, ctx_pos, anchors, valid, doc_ids = training_batch(cfg)
    mask = block_attention_mask(anchors, valid, doc_ids, cfg.block_size)
    q_rope = rope_tables(q_pos, cfg.head_dim, cfg.rope_theta, embeds.dtype)
    kv_rope = rope_tables(torch.cat([ctx_pos, q_pos], dim=1), cfg.head_dim, cfg.rope_theta, embeds.dtype)
    ctx = model.hidden_norm(model.fc(features))
    for layer in model.layers:
        layer.self_attn(embeds, ctx, q_rope, kv_rope, mask)
    assert seen == [(mask, options)] * cfg.num_layers
    model.set_attention_kernel_options({})  # back to torch's own choice
    assert all(layer.self_attn.kernel_options is None for layer in model.layers)
    with pytest.raises(DflashError, match="unknown flex_attention kernel option bwd_BLOCK_Q1 .*BLOCK_M1"):
        model.set_attention_kernel_options({"bwd_BLOCK_Q1": 64})


@pytest.mark.parametrize("heads, kv_heads, repeat", [(24, 4, 3), (24, 8, 3), (16, 4, 1), (24, 12, 1), (10, 2, 5)])
def test_the_flash_backend_repeats_kv_heads_to_a_power_of_two_group(heads, kv_heads, repeat):
    assert drafter_module.flash_kv_repeat(heads, kv_heads, {"BACKEND": "FLASH"}) == repeat
    for triton in (None, {}, {"BACKEND": "TRITON"}, {"bwd_num_warps": 8}):
        assert drafter_module.flash_kv_repeat(heads, kv_heads, triton) == 1


def test_kv_heads_repeated_for_the_flash_backend_give_the_same_attention(monkeypatch):
    """With BACKEND=FLASH groups of 6 query heads per K / V head run as 3 copies of each K / V head, groups of 2
    (flash_kv_repeat): each query head must still meet its own K / V head. flex_attention runs on the CPU here
    (the option only names the GPU kernels, so it is dropped on the way in), in float64, against the plain call."""
    cfg = small_config(num_attention_heads=12, num_key_value_heads=2)  # two K / V heads: a mix-up shows
    model = make_drafter(cfg)
    real, seen = drafter_module.flex_attention, []

    def cpu_flex(q, k, v, *, block_mask, enable_gqa, kernel_options):
        seen.append(k.shape[1])
        return real(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)

    monkeypatch.setattr(drafter_module, "flex_attention", cpu_flex)
    embeds, features, q_pos, ctx_pos, anchors, valid, doc_ids = training_batch(cfg)
    mask = block_attention_mask(anchors, valid, doc_ids, cfg.block_size)
    q_rope = rope_tables(q_pos, cfg.head_dim, cfg.rope_theta, embeds.dtype)
    kv_rope = rope_tables(torch.cat([ctx_pos, q_pos], dim=1), cfg.head_dim, cfg.rope_theta, embeds.dtype)
    attention = model.layers[0].self_attn
    with torch.no_grad():
        ctx = model.hidden_norm(model.fc(features))
        plain = attention(embeds, ctx, q_rope, kv_rope, mask)
        model.set_attention_kernel_options({"BACKEND": "FLASH"})
        repeated = attention(embeds, ctx, q_rope, kv_rope, mask)
    assert seen == [2, 6]
    torch.testing.assert_close(repeated, plain, rtol=1e-12, atol=1e-12)
    model.set_attention_kernel_options({})
    assert all(layer.self_attn.kv_repeat == 1 for layer in model.layers)
