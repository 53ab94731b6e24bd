"""bench/attention_ceiling.py's step attention cut into dense per-group calls, each group's rectangle masked whole or
split into an unmasked prefix merged with a masked rest: the same outputs and gradients as one SDPA over the
step's whole brute-force mask, in float64, whatever the group count."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench.attention_ceiling import additive_mask, grouped_attention, query_groups
from bench.mask_tiles import row_anchors
from dflash.drafter.blocks import dense_block_mask


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("docs, doc_len, anchors, groups", [(1, 512, 24, 4), (3, 160, 30, 7), (2, 256, 16, 16)])
def test_the_grouped_dense_calls_equal_one_call_over_the_whole_mask(docs, doc_len, anchors, groups, split):
    block, heads, head_dim = 4, 2, 8
    starts, valid, doc_ids = row_anchors(docs, doc_len, anchors, block, seed=3)
    visible = dense_block_mask(starts, valid, doc_ids, block)[0]
    context, queries = docs * doc_len, anchors * block
    spans = query_groups(visible, context, groups, block, align=32, split=split)
    assert [q0 for q0, *_ in spans] == sorted(q0 for q0, *_ in spans) and spans[-1][1] == queries
    assert all((q1 - q0) % block == 0 for q0, q1, *_ in spans)  # whole blocks: a block's keys stay in its group
    for q0, q1, prefix, lo, hi, mask in spans:
        assert visible[q0:q1, :prefix].all() and prefix <= lo <= hi <= context and prefix % 32 == 0
        assert int(visible[q0:q1].sum()) == (q1 - q0) * prefix + int(mask.sum())  # every visible pair computed
    assert (max(prefix for _, _, prefix, *_ in spans) > 0) == split  # groups of the first document share one
    spans = [(*span, additive_mask(m, torch.float64)) for *span, m in spans]  # the flash kernel takes no bool mask

    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, heads, n, head_dim, generator=generator, dtype=torch.float64).requires_grad_()
        for n in (queries, context + queries, context + queries)
    )
    grad = torch.randn(1, heads, queries, head_dim, generator=generator, dtype=torch.float64)
    grouped = grouped_attention(q, k, v, spans, context)
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    torch.testing.assert_close(grouped, whole, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(grouped, (q, k, v), grad), torch.autograd.grad(whole, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_script_checks_its_grouped_calls_against_the_steps_own_call():
    """The bench's whole grouped path (masks made once as SDPA's float bias, K and V repeated to the query heads,
    the prefix merged through the CPU's flash kernels, the check before timing) on the CPU, as the GPU run takes it
    with cuDNN: 2 rows x 2 group counts x (masked, prefix + masked)."""
    script = Path(__file__).resolve().parents[1] / "bench" / "attention_ceiling.py"
    run = subprocess.run(
        [sys.executable, str(script), "--tiny", "--query-groups", "2,3", "--iters", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    errors = [float(e) for e in re.findall(r"error ([0-9.e+-]+)\)", run.stdout)]
    assert len(errors) == 8 and all(e < 1e-5 for e in errors), run.stdout
    assert re.search(r"prefix \+ masked/3, [1-9]\d*% unmasked", run.stdout), run.stdout  # the merge ran
