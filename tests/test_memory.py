"""The step's memory estimate (dflash.drafter.memory) against the peaks measured on one H200, what --recompute takes off
it (counted from the compiled graph), and its refusal."""

import dataclasses
import math

import pytest
import torch
from test_drafter import small_config
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from dflash import methods
from dflash.drafter.memory import (
    StepShape,
    check_memory,
    embedding_on_host,
    fitting_anchors,
    parameter_count,
    step_memory,
)
from dflash.drafter.model import MLP, RMSNorm, rope_tables
from dflash.errors import DflashError


def drafter(hidden: int, heads: int, ffn: int, method: str = "dflash"):
    """bench/train.py's drafters: 5 layers, 4 KV heads of 256, vocabulary 248320, 5 tapped layers, the method's
    default block (16; DSpark's 7)."""
    return methods.get(method).config_cls(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=4,
        head_dim=256,
        num_layers=5,
        vocab_size=248320,
        mask_token_id=0,
        target_layer_ids=[1, 8, 15, 22, 29],
        num_target_layers=32,
        block_size=7 if method == "dspark" else 16,
        max_position_embeddings=262144,
    )


A, B = (5120, 24, 17408), (2560, 16, 9216)  # 27B-class and 4B-class targets' widths, heads and FFN


def gpu_shape(
    dcfg, token_budget: int, anchors: int = 2048, rows: int = 1, loss_chunk: int = 2048, teacher: str | None = None
) -> StepShape:
    per_token = dcfg.feature_dim * 2 + 4 * 4  # bf16 features and four int32 token arrays
    model_cls = methods.get(dcfg.method).model_cls
    return StepShape(
        rows,
        1,
        token_budget,
        anchors,
        loss_chunk,
        token_budget * per_token,
        parameter_count(model_cls, dcfg),
        0,
        True,
        teacher,
    )


# Peak allocated GB of bench/train.py on one H200 (docs/benchmarks.md, issue 24 and "Drafter methods"): 2048
# anchors, the method's block, DSpark with the store's teacher kind.
MEASURED = [
    (B, "dflash", None, "none", 12288, 33.4),
    (B, "dflash", None, "none", 32768, 35.3),
    (B, "dflash", None, "none", 65536, 38.2),
    (B, "dflash", None, "none", 131072, 44.4),
    (A, "dflash", None, "none", 12288, 73.9),
    (A, "dflash", None, "none", 32768, 77.1),
    (B, "dflash2", None, "none", 12288, 43.7),
    (B, "dspark", "topk", "none", 12288, 27.3),
    (B, "dspark", "hidden", "none", 12288, 31.2),
    # --recompute pointwise, 2026-12-03 18:45-18:58 UTC: not fitted, the count of the compiled graph
    (A, "dflash", None, "pointwise", 12288, 62.1),
    (B, "dflash", None, "pointwise", 12288, 26.6),
    (B, "dflash2", None, "pointwise", 12288, 30.5),
]


@pytest.mark.parametrize("widths, method, teacher, recompute, token_budget, peak_gb", MEASURED)
def test_the_estimate_matches_the_measured_gpu_peaks_within_2_percent(
    widths, method, teacher, recompute, token_budget, peak_gb
):
    dcfg = drafter(*widths, method)
    layers = parameter_count(methods.get(method).model_cls, dcfg, layers_only=True)
    shape = gpu_shape(dcfg, token_budget, teacher=teacher)
    estimate = sum(step_memory(dcfg, dataclasses.replace(shape, recompute=recompute, layer_parameters=layers)).values())
    assert estimate / 1e9 == pytest.approx(peak_gb, rel=0.02)


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("field", ["anchors", "token_budget", "rows", "loss_chunk", "parameters"])
def test_the_estimate_grows_with_every_shape(field, cuda):
    dcfg = drafter(*B)
    shape = dataclasses.replace(gpu_shape(dcfg, 12288), cuda=cuda)
    totals = [
        sum(step_memory(dcfg, dataclasses.replace(shape, **{field: getattr(shape, field) * k})).values())
        for k in (1, 2, 3, 4)
    ]
    assert totals == sorted(totals) and len(set(totals)) == 4


def test_a_step_past_the_free_gpu_memory_is_refused_naming_the_anchors_that_fit():
    dcfg = drafter(*A)
    shape = gpu_shape(dcfg, 131072)
    need = sum(step_memory(dcfg, shape).values())
    fits = sum(step_memory(dcfg, dataclasses.replace(shape, anchors=1024)).values())
    with pytest.raises(DflashError) as error:
        check_memory(dcfg, shape, (need + fits) // 2, torch.device("cuda"))
    message = str(error.value)
    assert f"needs about {need / 1e9:.1f} GB" in message and "free on the GPU" in message
    anchors = int(message.split("--anchors ")[1].split()[0])
    assert 1024 <= anchors < 2048
    assert sum(step_memory(dcfg, dataclasses.replace(shape, anchors=anchors)).values()) <= (need + fits) // 2
    assert sum(step_memory(dcfg, dataclasses.replace(shape, anchors=anchors + 1)).values()) > (need + fits) // 2
    assert check_memory(dcfg, shape, need, torch.device("cuda")) == need  # what fits passes
    assert check_memory(dcfg, shape, None, torch.device("cuda")) == need  # unknown (or ignored): passes


def test_on_the_cpu_only_nine_tenths_of_the_available_memory_count():
    """The OS kills a CPU step past the memory without a word, and the estimate runs up to 12 % low there."""
    dcfg = drafter(*B)
    shape = dataclasses.replace(gpu_shape(dcfg, 12288, anchors=128), cuda=False)
    need = sum(step_memory(dcfg, shape).values())
    assert check_memory(dcfg, shape, round(need / 0.9) + 1, torch.device("cpu")) == need
    with pytest.raises(DflashError, match=r"MemAvailable; 90% of it counts\): --anchors \d+ fits \(128 now\)"):
        check_memory(dcfg, shape, need, torch.device("cpu"))


@pytest.mark.parametrize("method", ["dflash", "dflash2"])
def test_the_anchors_that_fit_are_the_last_of_a_brute_force_scan(method):
    dcfg = drafter(*B, method=method)
    shape = gpu_shape(dcfg, 65536, anchors=600)
    totals = [sum(step_memory(dcfg, dataclasses.replace(shape, anchors=a)).values()) for a in range(1, 601)]
    for usable in (totals[0] - 1, totals[0], totals[137], (totals[299] + totals[300]) // 2, totals[-1], 10**15):
        scanned = max((a for a, need in enumerate(totals, start=1) if need <= usable), default=None)
        assert fitting_anchors(dcfg, shape, usable) == scanned


def kept_for_backward(fn, *inputs) -> list:
    """The values the compiled `fn` keeps for its backward under inductor's partitioner (min-cut), on the CPU: the
    forward graph's extra outputs (fx nodes, `meta["val"]` their fake tensors)."""
    kept = []

    def forward_compiler(gm, _):
        kept.extend(next(n for n in gm.graph.nodes if n.op == "output").args[0][1:])
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        partition_fn=min_cut_rematerialization_partition,
    )
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs).sum().backward()
    return kept


def activations_kept_by_the_compiled_mlp(recompute: bool, tokens: int = 80) -> list[int]:
    """The widths of the activations of `tokens` rows that the compiled step keeps for the backward of
    x + mlp(norm(x)) under bf16 autocast."""
    cfg = small_config()
    norm, mlp = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), MLP(cfg)
    mlp.recompute = recompute

    def block(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return x + mlp(norm(x))

    x = torch.randn(2, tokens // 2, cfg.hidden_size, requires_grad=True)
    shapes = [tuple(node.meta["val"].shape) for node in kept_for_backward(block, x)]
    return sorted(s[-1] for s in shapes if s[-1] > 1 and math.prod(s[:-1]) == tokens)  # not rsqrt's [.., 1]


def test_recompute_mlp_drops_what_the_formula_takes_off():
    """The formula's `3 F + H` of --recompute mlp: without it the compiled step keeps the normed input (H), gate, up
    and their product (F each) besides the layer's input; with it the layer's input alone (the MLP runs again from
    it)."""
    H, F = small_config().hidden_size, small_config().intermediate_size
    assert H != F
    assert activations_kept_by_the_compiled_mlp(False) == sorted([H, H, F, F, F])  # x, norm(x), gate, up, product
    assert activations_kept_by_the_compiled_mlp(True) == [H]  # x
    dcfg = drafter(*A)
    shape = gpu_shape(dcfg, 12288)
    full, recomputed = step_memory(dcfg, shape), step_memory(dcfg, dataclasses.replace(shape, recompute="mlp"))
    Q, L = 2048 * 16, dcfg.num_layers
    kept_less = full["block activations"] - recomputed["block activations"]
    assert kept_less == pytest.approx(Q * L * (3 * dcfg.intermediate_size + dcfg.hidden_size) * 2, abs=1)
    rebuilt = "recomputed in a layer's backward"
    assert recomputed[rebuilt] == Q * 3 * dcfg.intermediate_size * 2 and full[rebuilt] == 0


def bf16_kept_by_a_compiled_layer(method: str, recompute: str, blocks: int, context: int) -> list[tuple]:
    """Shapes of the bf16 tensors a one-layer drafter's compiled layer keeps for its backward under bf16 autocast
    (the forward graph's extra outputs after inductor's min-cut partitioner, on the CPU), the layer's input not
    counted: `blocks` blocks of 4 tokens in each of 2 rows over `context` context tokens."""
    cfg = methods.get(method).config_cls(
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        num_layers=1,
        vocab_size=50,
        mask_token_id=0,
        target_layer_ids=[0],
        num_target_layers=2,
        block_size=4,
        sliding_window=None,
    )
    torch.manual_seed(0)
    model = methods.get(method).model_cls(cfg)
    model.set_recompute(recompute)
    R, Q, T = 2, 4 * blocks, context
    x, ctx = torch.randn(R, Q, 64, requires_grad=True), torch.randn(R, T, 64, requires_grad=True)
    q_rope = rope_tables(torch.arange(Q).expand(R, Q), 8, 1e4, torch.float32)
    kv_rope = rope_tables(torch.arange(T + Q).expand(R, T + Q), 8, 1e4, torch.float32)

    def layer(x, ctx):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model._run_layer(model.layers[0], x, ctx, q_rope, kv_rope, None)

    kept = [
        tuple(node.meta["val"].shape)
        for node in kept_for_backward(layer, x, ctx)
        if node.op != "placeholder" and node.meta["val"].dtype == torch.bfloat16
    ]
    return kept, cfg


def kept_per_token(method: str, recompute: str) -> tuple[float, float, list[tuple], object]:
    """(bf16 values kept per block token, per context token, the shapes at the smallest size, the config), from
    the growth of the kept bytes with each."""
    # 2 rows of 20 or 40 block tokens, 16 or 32 context tokens: no activation has a weight's shape
    (small, cfg), (more_blocks, _), (more_context, _) = (
        bf16_kept_by_a_compiled_layer(method, recompute, blocks, context)
        for blocks, context in ((5, 16), (10, 16), (5, 32))
    )
    size = lambda shapes: sum(math.prod(s) for s in shapes)  # noqa: E731
    return (size(more_blocks) - size(small)) / (2 * 20), (size(more_context) - size(small)) / (2 * 16), small, cfg


@pytest.mark.parametrize("method", ["dflash", "dflash2"])
def test_recompute_pointwise_keeps_what_the_formula_counts(method):
    """--recompute pointwise: a layer keeps its input (not counted here) and its matmuls' and attention's outputs,
    which is the formula's block copies less the input; per context token the k and v; no bf16 weight copy. Without
    it the compiled layer keeps more of each (the norms, RoPE'd q and k, the SwiGLU product, the weight copies)."""
    per_block, per_context, shapes, cfg = kept_per_token(method, "pointwise")
    H, F, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    assert len({H, F, kv, q}) == 4
    formula = 2 * H + 2 * q + 2 * kv + 2 * F + cfg.method_activation_copies("pointwise") * H
    assert per_block == formula - H  # the formula counts the layer's input too
    assert per_context == 2 * kv
    weights = {tuple(p.shape) for p in methods.get(method).model_cls(cfg).layers[0].parameters()}
    assert not weights & ({s for s in shapes} | {s[::-1] for s in shapes})
    full_block, full_context, full_shapes, _ = kept_per_token(method, "none")
    assert full_block > per_block + F + H and full_context > per_context
    assert {s[::-1] for s in full_shapes} & weights  # autocast's bf16 copies of the weights, transposed


def test_recompute_pointwise_takes_off_the_formula_what_it_counts():
    dcfg = drafter(*A)
    layers = parameter_count(methods.get("dflash").model_cls, dcfg, layers_only=True)
    shape = dataclasses.replace(gpu_shape(dcfg, 12288), recompute="pointwise", layer_parameters=layers)
    full, pointwise = step_memory(dcfg, gpu_shape(dcfg, 12288)), step_memory(dcfg, shape)
    H, F, q, kv = 5120, 17408, 24 * 256, 4 * 256
    assert pointwise["block activations"] == 2048 * 16 * 5 * (2 * H + 2 * q + 2 * kv + 2 * F) * 2
    assert full["weights and optimizer"] - pointwise["weights and optimizer"] == layers * 4 // 5 * 2
    assert pointwise["recomputed in a layer's backward"] == 2048 * 16 * (2 * H + 2 * q + F + kv) * 2


def test_the_gpu_refusal_names_what_recompute_pointwise_would_need():
    dcfg = drafter(*A)
    layers = parameter_count(methods.get("dflash").model_cls, dcfg, layers_only=True)
    shape = dataclasses.replace(gpu_shape(dcfg, 12288), layer_parameters=layers)
    need = sum(step_memory(dcfg, shape).values())
    lighter = sum(step_memory(dcfg, dataclasses.replace(shape, recompute="pointwise")).values())
    assert lighter < need
    for usable, verdict in ((lighter, "fits"), (lighter - 1, "does not fit either")):
        with pytest.raises(DflashError) as error:
            check_memory(dcfg, shape, usable, torch.device("cuda"))
        assert f"--recompute pointwise (no matmul repeated) needs about {lighter / 1e9:.1f} GB and {verdict};" in str(
            error.value
        )
    with pytest.raises(DflashError) as error:  # already recomputing: nothing more to offer there
        check_memory(dcfg, dataclasses.replace(shape, recompute="pointwise"), lighter - 1, torch.device("cuda"))
    assert "--recompute pointwise" not in str(error.value)


@pytest.mark.parametrize("cuda", [True, False])
def test_auto_embedding_takes_the_layout_of_less_memory_on_a_gpu(cuda):
    """--embedding auto ships the token embeddings from the host where that takes less device memory than the
    table (rows of a few thousand tokens against a 248 K vocabulary), keeps the table where the rows are longer,
    and keeps it on the CPU, where no device memory is saved."""
    dcfg = drafter(*A)
    chosen = []
    for T in (3072, 12288, 65536, 131072, 262144):
        shape = dataclasses.replace(gpu_shape(dcfg, T), cuda=cuda)
        host = embedding_on_host("auto", cuda, T, dcfg.vocab_size)
        chosen.append(host)
        need = {on: sum(step_memory(dcfg, dataclasses.replace(shape, embedding_on_host=on)).values()) for on in (0, 1)}
        if cuda:
            assert need[host] < need[not host]
    assert chosen == ([True, True, True, False, False] if cuda else [False] * 5)
    # 2 x 12288 x 5120 bf16 values (the step's and the staging copy) instead of the 248320 x 5120 table
    shape = gpu_shape(dcfg, 12288)
    saved = sum(step_memory(dcfg, shape).values()) - sum(
        step_memory(dcfg, dataclasses.replace(shape, embedding_on_host=True)).values()
    )
    assert saved == (248320 - 2 * 12288) * 5120 * 2
    assert embedding_on_host("host", False, 10**6, 10) and not embedding_on_host("device", True, 1, 10**6)


def test_the_readers_host_memory_is_what_they_pin_and_a_host_too_small_is_refused(monkeypatch):
    """train_setup.check_host_memory counts the page-locked batches the readers allocate (checked against
    reader.allocate_batch's own tensors), and refuses a GPU run whose rank's share of the host's memory is smaller,
    naming the options that lower it; --ignore-memory-estimate lets it run."""
    from dflash.config import TrainConfig
    from dflash.drafter import memory as memory_module
    from dflash.train.reader import BatchShape, allocate_batch, row_fields
    from dflash.train.setup import check_host_memory

    T, width = 512, 320
    layout = {"hidden": ((T, width), "uint16"), "input_ids": ((T,), "int32"), "loss_mask": ((T,), "uint8")}
    fields = row_fields(layout)
    cfg = TrainConfig(store="s", out="o", rows_per_step=2, grad_accum=3, prefetch=2, val_every=10)
    table = 4096 * 64 * 2

    def pinned(micro_batches, rows):  # what one reader slot holds, but the anchor keys (8 bytes a row)
        batch = allocate_batch(BatchShape(micro_batches, rows, fields), "cpu")
        return sum(t.numel() * t.element_size() for name, t in batch.items() if name != "anchor_keys")

    expected = (cfg.prefetch + 1) * (pinned(3, 2) + pinned(1, 2)) + table
    assert check_host_memory(cfg, fields, table, torch.device("cpu")) == expected
    no_val = dataclasses.replace(cfg, val_every=0)
    assert check_host_memory(no_val, fields, 0, torch.device("cpu")) == (cfg.prefetch + 1) * pinned(3, 2)

    monkeypatch.setattr(memory_module, "available_memory", lambda device: 4 * (expected - 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    with pytest.raises(DflashError) as refused:
        check_host_memory(cfg, fields, table, cuda)
    message = str(refused.value)
    assert "page-locked host batches need about" in message and "/ 4 ranks on this host" in message
    assert "--prefetch 2 steps ahead" in message and "lower --prefetch" in message
    assert check_host_memory(dataclasses.replace(cfg, ignore_memory_estimate=True), fields, table, cuda) == expected
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert check_host_memory(cfg, fields, table, cuda) == expected  # the whole host is this rank's
