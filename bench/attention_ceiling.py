"""What the train step's attention could reach: flex_attention with the step's own BlockMask against dense kernels
over the same number of visible (query, key) pairs, forward and backward, at a bench drafter's heads and a row
shape. It says how much of the long-row step's time is the mask and how much the attention kernel at this head dim.

Cases, each timed alone (random bf16 q, k, v; compiled where flex_attention is used):
    step mask, flex      the trainer's call: BlockMask of dflash.drafter.blocks over 1 row, its default tiles and kernel
                         options (dflash.drafter.attention), GQA as the drafter has it
    causal, flex         the same kernel and options over a plain causal mask of length L, L(L+1)/2 ~= the pairs
    causal, sdpa-X       torch's SDPA backends (flash, cudnn, efficient) over that causal problem; K and V repeated
                         to the query heads first (not every backend takes GQA), their copy not timed
    step mask, cudnn masked/N
                         the step's exact attention as N dense SDPA calls on cuDNN, one per run of consecutive
                         blocks (anchors sorted): each over the context span its blocks see and its own blocks' keys,
                         with the step's mask cut to that rectangle; computes more pairs than are visible (printed),
                         K and V repeated to the query heads inside the timing, its outputs and gradients checked
                         against the step's own call first (the error printed). Whether a dense kernel over the
                         mask's rectangles beats flex_attention at head_dim 256 (--query-groups; with --tiny, torch's
                         math kernel on the CPU: a check of the script, not a timing). It does not: 1.3-3.4x flex's
                         time on an H100 (docs/benchmarks.md, "Long rows", 2026-12-05)
    step mask, flex {JSON}
                         the trainer's call with other kernel options (--flex-options, as bench/train.py's: JSON
                         objects, "mask_tile_size" the BlockMask's tiles, e.g. {"BACKEND": "FLASH"} for the CuTe
                         flash kernels of flash-attn-4), its outputs and gradients checked against the first case's
    step mask, cudnn prefix + masked/N
                         each group's rectangle split: the context keys all its queries see from the row's start,
                         attended unmasked, merged by log-sum-exp with a masked call over the rest (PrefixMerged).
                         Faster than the masked whole, still 1.29-1.37x flex's time (H100, 2026-12-05)
FLOPs as the trainer's MFU counts them (docs/training.md): forward 4 x pairs x heads x head_dim, backward 2.5x that.
(flex's backward runs QK^T and dO V^T once more in its dQ pass: 3.5x the forward's products executed.)

On the H200 (bench/device_setup.sh first):
    python3 bench/attention_ceiling.py --drafter b --row-shapes 4x3072:512,1x32768:2048
    python3 bench/attention_ceiling.py --drafter b --row-shapes 1x32768:2048 --head-dim 128   # 32 / 8 heads of 128
    python3 bench/attention_ceiling.py --drafter b --row-shapes 1x32768:2048 --query-groups 16,32,64
    python3 bench/attention_ceiling.py --drafter b --row-shapes 1x32768:2048 --flex-options '{"BACKEND": "FLASH"}'
    python bench/attention_ceiling.py --tiny        # the CPU: the dense-mask SDPA the CPU trainer runs, toy shapes
    python bench/attention_ceiling.py --tiny --query-groups 2,3     # the grouped calls' script, checked on the CPU
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's dflash

from bench.mask_tiles import row_anchors  # noqa: E402
from bench.topk import ms_per_call  # noqa: E402
from bench.train import DRAFTERS, TINY, flex_train_options, parse_flex_options, parse_row_shapes  # noqa: E402
from dflash.drafter import (  # noqa: E402
    attention,
    blocks,
    heads_at_head_dim,  # noqa: E402
)
from dflash.drafter.flops import visible_pairs  # noqa: E402
from dflash.errors import DflashError  # noqa: E402

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
PEAK_TFLOPS = 792.0  # bf16 matmul on the H200 (shared/DEVICE.md)


def step_problem(s: dict, shape: dict, block: int, device: torch.device, seed: int):
    """The step's anchors over one row of `shape`: (BlockMask or dense bias, query tokens, key tokens, pairs, the
    anchors as dflash.drafter.blocks takes them: (anchors, valid, doc ids))."""
    T = shape["docs_per_row"] * shape["doc_len"]
    A = shape["docs_per_row"] * shape["anchors_per_doc"]
    anchors, valid, doc_ids = row_anchors(shape["docs_per_row"], shape["doc_len"], A, block, seed, device)
    pairs = int(visible_pairs(anchors, valid, doc_ids, block))
    if device.type == "cuda":
        tile = attention.default_mask_tile(s["head_dim"])
        mask = blocks.block_attention_mask(anchors, valid, doc_ids, block, tile_size=tile)
    else:
        mask = blocks.dense_attention_bias(anchors, valid, doc_ids, block)
    return mask, A * block, T + A * block, pairs, (anchors, valid, doc_ids)


def query_groups(visible: torch.Tensor, context: int, groups: int, block: int, align: int = 128, split=False):
    """Cut the step's queries into `groups` runs of whole blocks: (query start, end, prefix, context key start, end,
    mask) each. The rectangle is the context span every key any of its queries sees, widened to `align` (so cuDNN's
    key tiles are whole), and its own block keys; mask [queries, span + its own block keys] is the step's mask cut to
    it. With `split`, the context keys that every query of the group sees from the row's start on, rounded down to
    `align`, are a prefix [0, prefix) of their own, with no mask, and the rectangle starts after them (prefix 0
    otherwise). visible: the step's bool mask [Q, T + Q]."""
    q_len = visible.shape[0]
    blocks_per_group = -(-q_len // block // groups)
    spans = []
    for q0 in range(0, q_len, blocks_per_group * block):
        q1 = min(q_len, q0 + blocks_per_group * block)
        prefix = 0
        if split:
            unseen = (~visible[q0:q1, :context].all(dim=0)).nonzero()
            prefix = int(unseen[0]) if len(unseen) else context
            prefix -= prefix % align
        seen = visible[q0:q1, prefix:context].any(dim=0).nonzero() + prefix
        lo, hi = (int(seen.min()), int(seen.max()) + 1) if len(seen) else (prefix, prefix)
        lo, hi = lo - lo % align, min(context, -(-hi // align) * align)  # prefix is a multiple of align
        mask = torch.cat([visible[q0:q1, lo:hi], visible[q0:q1, context + q0 : context + q1]], dim=1)
        spans.append((q0, q1, prefix, lo, hi, mask))
    return spans


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive one the merged calls' kernels take (0: visible, -inf: hidden)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class PrefixMerged(torch.autograd.Function):
    """One query group's attention as two calls merged by their log-sum-exps: unmasked over the prefix of context
    keys all its queries see, masked (an additive bias) over the rest of its rectangle. The backward runs each
    call's backward kernel with the merged output and log-sum-exp, which is the whole softmax's backward restricted
    to that call's keys, so no gradient flows through a log-sum-exp. cuDNN's private ops on CUDA, the CPU's flash
    kernel elsewhere (the same interface, float64 included)."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_rest, v_rest, bias):
        out1, lse1, state1 = _attend(q, k_prefix, v_prefix, None)
        out2, lse2, state2 = _attend(q, k_rest, v_rest, bias)
        lse = torch.logaddexp(lse1, lse2)
        w1, w2 = (torch.exp(x - lse).view(*lse.shape[:3], 1) for x in (lse1, lse2))
        wide = torch.promote_types(q.dtype, torch.float32)  # bf16 merged in float32, float64 kept
        out = (out1.to(wide) * w1 + out2.to(wide) * w2).to(q.dtype).contiguous()  # the layout grad will have
        ctx.save_for_backward(q, k_prefix, v_prefix, k_rest, v_rest, bias, out, lse)
        ctx.states = (state1, state2)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_prefix, v_prefix, k_rest, v_rest, bias, out, lse = ctx.saved_tensors
        dq1, dk1, dv1 = _attend_backward(grad, q, k_prefix, v_prefix, out, lse, None, ctx.states[0])
        dq2, dk2, dv2 = _attend_backward(grad, q, k_rest, v_rest, out, lse, bias, ctx.states[1])
        return dq1 + dq2, dk1, dv1, dk2, dv2, None


def _attend(q, k, v, bias):
    """(out, log-sum-exp, what the backward kernel needs besides) of one attention call, bias None for none."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, True
        )
        return out, lse, (seed, offset, cum_q, cum_k, max_q, max_k)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias)
    return out, lse, None


def _attend_backward(grad, q, k, v, out, lse, bias, state):
    if q.is_cuda:
        seed, offset, cum_q, cum_k, max_q, max_k = state
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad.contiguous(), q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, 0.0, False
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=bias
    )


def grouped_attention(q, k, v, spans, context: int):
    """The step's attention as dense calls per query group of `query_groups` (K, V: [1, H, T + Q, d]): one SDPA
    call over each rectangle, or, where a group has a prefix, the prefix and the rectangle merged (PrefixMerged)."""
    outs = []
    for q0, q1, prefix, lo, hi, mask in spans:
        keys = torch.cat([k[:, :, lo:hi], k[:, :, context + q0 : context + q1]], dim=2)
        values = torch.cat([v[:, :, lo:hi], v[:, :, context + q0 : context + q1]], dim=2)
        if prefix:
            k_prefix, v_prefix = k[:, :, :prefix], v[:, :, :prefix]
            outs.append(PrefixMerged.apply(q[:, :, q0:q1], k_prefix, v_prefix, keys, values, mask))
        else:
            outs.append(F.scaled_dot_product_attention(q[:, :, q0:q1], keys, values, attn_mask=mask))
    return torch.cat(outs, dim=2)


def causal_mask(length: int, tile: int, device: torch.device):
    return create_block_mask(
        lambda b, h, q, kv: kv <= q, B=None, H=None, Q_LEN=length, KV_LEN=length, device=device, BLOCK_SIZE=tile
    )


def measure(attend, q, k, v, iters: int, device: torch.device) -> tuple[float, float]:
    """(forward ms, backward ms) of out = attend(q, k, v): the backward as forward+backward minus forward."""
    grad = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            attend(q, k, v)

    def forward_backward():
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad)

    fwd = ms_per_call(forward, iters, device)
    return fwd, ms_per_call(forward_backward, iters, device) - fwd


def inputs(heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, device, dtype):
    def make(h, n):
        return torch.randn(1, h, n, head_dim, device=device, dtype=dtype).requires_grad_()

    return make(heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len)


def cases(s: dict, shape: dict, block: int, device: torch.device, seed: int, query_groups_list=(), flex_sets=()):
    """(name, attend, (q, k, v), pairs per head) of every case at this shape."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    H, G, d = s["heads"], s["kv_heads"], s["head_dim"]
    mask, q_len, kv_len, pairs, step_anchors = step_problem(s, shape, block, device, seed)
    if device.type != "cuda":  # the CPU trainer's path: SDPA over the dense bias

        def step_attend(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        yield "step mask, sdpa (CPU)", step_attend, inputs(H, G, q_len, kv_len, d, device, dtype), pairs
        flex_sets = ()  # no flex_attention kernels on the CPU
    else:
        options = attention.attention_kernel_options({}, True, d)
        flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)  # each row shape compiled static

        def step_attend(q, k, v):
            return flex(q, k, v, block_mask=mask, enable_gqa=G != H, kernel_options=options)

        yield "step mask, flex", step_attend, inputs(H, G, q_len, kv_len, d, device, dtype), pairs
    if flex_sets or query_groups_list:  # cases that replace the step's own call: each checked against it first
        step = inputs(H, G, q_len, kv_len, d, device, dtype)
        reference = outputs_and_grads(step_attend, step)
    for name, attend in flex_option_cases(s, step_anchors, block, flex_sets):
        yield checked_case(name, attend, step, reference, pairs)
    if device.type == "cuda":
        yield from causal_cases(s, pairs, flex, options, device, dtype)
    if query_groups_list:
        visible = blocks.dense_block_mask(*step_anchors, block)[0]
        for name, attend in grouped_cases(s, visible, kv_len - q_len, block, device, dtype, pairs, query_groups_list):
            yield checked_case(name, attend, step, reference, pairs)


def checked_case(name: str, attend, step, reference, pairs: int):
    """A case's row once its outputs and gradients are compared with the step's own call (`reference`, on the
    inputs `step`): the error in its name, or a failed row where it has no kernel. A wrong or NaN kernel must not
    pass as a fast one."""
    try:
        error = max(relative_error(a, b) for a, b in zip(outputs_and_grads(attend, step), reference))
    except (RuntimeError, torch._dynamo.exc.TorchDynamoException) as exc:
        print(f"{name} failed:\n{exc}", file=sys.stderr)  # the table keeps its first line
        return name, refused(exc), step, pairs
    return f"{name} (error {error:.1e})", attend, step, pairs


def flex_option_cases(s: dict, step_anchors, block: int, flex_sets):
    """(name, attend) of the step's flex_attention call under each --flex-options set, its BlockMask rebuilt where
    the set names other tiles."""
    H, G, d = s["heads"], s["kv_heads"], s["head_dim"]
    for name, given in flex_sets:
        train = flex_train_options(given)
        tile = train.get("mask_tile_size") or attention.default_mask_tile(d)
        mask = blocks.block_attention_mask(*step_anchors, block, tile_size=tile)
        kernel = train["attention_kernel_options"]
        own = torch.compile(flex_attention, fullgraph=True, dynamic=False)  # its own cache: no recompile limit

        def attend(q, k, v, mask=mask, kernel=kernel, own=own):
            return own(q, k, v, block_mask=mask, enable_gqa=G != H, kernel_options=kernel)

        yield f"step mask, flex {name}", attend


def causal_cases(s: dict, pairs: int, flex, options: dict, device: torch.device, dtype):
    """flex and SDPA's dense kernels over a causal problem of about as many pairs as the step's."""
    H, G, d = s["heads"], s["kv_heads"], s["head_dim"]
    length = int(round((2 * pairs) ** 0.5))
    length -= length % 256
    causal_pairs = length * (length + 1) // 2
    causal = causal_mask(length, attention.default_mask_tile(d), device)
    yield (
        "causal, flex",
        lambda q, k, v: flex(q, k, v, block_mask=causal, enable_gqa=G != H, kernel_options=options),
        inputs(H, G, length, length, d, device, dtype),
        causal_pairs,
    )
    for name, backend in SDPA_BACKENDS.items():

        def attend(q, k, v, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        yield f"causal, sdpa-{name}", attend, inputs(H, H, length, length, d, device, dtype), causal_pairs


def grouped_cases(s: dict, visible, T: int, block: int, device, dtype, pairs: int, groups_list):
    """(name, attend) of the step mask (`visible`, bool [Q, T + Q]) as dense calls over query groups (cuDNN; on the
    CPU torch's math and flash kernels, which check the script rather than time a kernel), each group's rectangle
    masked whole, then split into an unmasked prefix and a masked rest."""
    H, G = s["heads"], s["kv_heads"]
    backend = SDPA_BACKENDS["cudnn"] if device.type == "cuda" else SDPBackend.MATH
    align = 128 if device.type == "cuda" else 32  # cuDNN's key tiles; the CPU's toy rows are short
    for groups, split in ((n, split) for n in groups_list for split in (False, True)):
        spans = [  # SDPA's additive mask in the query dtype, made once as a trainer would
            (*span, additive_mask(m, dtype)) for *span, m in query_groups(visible, T, groups, block, align, split)
        ]
        computed = sum((q1 - q0) * (prefix + m.shape[1]) for q0, q1, prefix, _, _, m in spans)
        unmasked = sum((q1 - q0) * prefix for q0, q1, prefix, *_ in spans)

        def attend(q, k, v, spans=spans):
            with sdpa_kernel(backend):
                return grouped_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1), spans, T)

        kind = f"prefix + masked/{groups}, {unmasked / computed:.0%} unmasked" if split else f"masked/{groups}"
        yield f"step mask, {backend.name.lower()} {kind} ({computed / pairs:.2f}x the pairs)", attend


def refused(exc: Exception):
    def attend(*_):
        raise exc

    return attend


def outputs_and_grads(attend, qkv):
    out = attend(*qkv)
    grads = torch.autograd.grad(out, qkv, torch.ones_like(out))
    return [out.detach(), *grads]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", choices=["a", "b"], default="b")
    parser.add_argument("--row-shapes", default="4x3072:512,1x32768:2048", help="DOCSxLENGTH:ANCHORS_PER_DOC,...")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--head-dim",
        type=int,
        help="the drafter's attention at this head dim, its widths kept (as train's --drafter-option head_dim=N)",
    )
    parser.add_argument(
        "--query-groups", default="", help="N,...: the step mask as N dense cuDNN calls too (16,32,64; --tiny: 2,3)"
    )
    parser.add_argument(
        "--flex-options",
        default="",
        help="JSON;JSON...: the step's flex_attention call with these kernel options too (bench/train.py's form; "
        '"mask_tile_size" the BlockMask\'s tiles), e.g. \'{"BACKEND": "FLASH"}\'',
    )
    parser.add_argument("--tiny", action="store_true", help="toy shapes on the CPU")
    args = parser.parse_args()
    try:
        flex_sets = parse_flex_options(args.flex_options) if args.flex_options else []
    except ValueError as exc:
        parser.error(f"--flex-options: {exc}")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    s = dict((TINY if args.tiny else DRAFTERS)[args.drafter])
    if args.head_dim:
        fields = {"num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"]}
        try:
            heads = heads_at_head_dim(fields, args.head_dim)
        except DflashError as exc:
            parser.error(str(exc))
        s.update(heads=heads["num_attention_heads"], kv_heads=heads["num_key_value_heads"], head_dim=args.head_dim)
    shapes = parse_row_shapes("4x64:8,1x512:16" if args.tiny else args.row_shapes)
    print(f"drafter {args.drafter}: {s['heads']} / {s['kv_heads']} heads of {s['head_dim']}, block {args.block_size}")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}\n")
    if flex_sets and device.type != "cuda":
        print("--flex-options: not run (the CPU's attention is the dense mask, no flex_attention kernels)\n")
    print("| row | case | pairs / head | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd % of 792 |")
    print("|---|---|---|---|---|---|---|---|")
    groups = [int(n) for n in args.query_groups.split(",") if n]
    for shape in shapes:
        row = f"{shape['docs_per_row']} x {shape['doc_len']}, {shape['anchors_per_doc']} anchors/doc"
        for name, attend, qkv, pairs in cases(s, shape, args.block_size, device, args.seed, groups, flex_sets):
            flops = 4.0 * pairs * s["heads"] * s["head_dim"]
            try:
                fwd, bwd = measure(attend, *qkv, args.iters, device)
            except (RuntimeError, torch._dynamo.exc.TorchDynamoException) as exc:
                print(f"| {row} | {name} | {pairs:,} | failed: {str(exc).splitlines()[0][:80]} |")
                continue
            share = 100 * 3.5 * flops / ((fwd + bwd) * 1e9) / PEAK_TFLOPS
            print(
                f"| {row} | {name} | {pairs:,} | {fwd:.2f} | {flops / fwd / 1e9:.0f} | {bwd:.2f} "
                f"| {2.5 * flops / bwd / 1e9:.0f} | {share:.1f} % |"
            )
            del attend, qkv
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
