"""dflash.drafter.step_time: the pairs a drafter's blocks see, against the brute-force mask; the two rates, against the
measured steps they were fitted to and the measured steps they were not."""

import numpy as np
import pytest
import torch

from dflash.drafter.blocks import dense_block_mask, eligible_anchors
from dflash.drafter.step_time import (
    ATTENTION_SPEEDUP,
    BENCH_DRAFTERS,
    MEASURED,
    MeasuredStep,
    fitted_rates,
    measured_flops,
    nearest_bench_drafter,
    pairs_per_anchor,
    rates_at,
    uniform_contexts,
)


def random_row(generator: np.random.Generator, length: int):
    """One row of documents of random lengths, each with a random prompt out of the loss, and padding at the end."""
    doc_ids, loss_mask, doc = [], [], 0
    while len(doc_ids) < length - 8:
        n = int(generator.integers(1, 40))
        prompt = int(generator.integers(0, n))
        doc_ids += [doc] * n
        loss_mask += [0] * prompt + [1] * (n - prompt)
        doc += 1
    doc_ids, loss_mask = doc_ids[: length - 8], loss_mask[: length - 8]
    doc_ids += [-1] * 8
    loss_mask += [0] * 8
    return torch.tensor([doc_ids]), torch.tensor([loss_mask], dtype=torch.uint8)


@pytest.mark.parametrize("window", [None, 1, 5, 16, 23])
def test_pairs_per_anchor_is_the_brute_force_masks_mean_over_every_eligible_anchor(window):
    generator, block_size = np.random.default_rng(0), 4
    doc_ids, loss_mask = random_row(generator, 300)
    anchors = eligible_anchors(loss_mask, doc_ids, block_size).nonzero()[:, 1][None]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    mask = dense_block_mask(anchors, valid, doc_ids, block_size, window)
    brute = mask.sum().item() / anchors.shape[1]
    # The histogram as dflash plan counts it, from each anchor's distance to its document's first position.
    starts = {int(d): int((doc_ids[0] == d).nonzero()[0]) for d in doc_ids[0].unique() if d >= 0}
    contexts = np.bincount([int(a) - starts[int(doc_ids[0, a])] for a in anchors[0]], minlength=300)
    assert pairs_per_anchor(contexts, block_size, window) == pytest.approx(brute, rel=1e-12)


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_fitted_rates_reproduce_their_two_measured_steps(name):
    rates = fitted_rates(name)
    assert 0 < rates.attention < rates.matmul < 792e12  # flex_attention slower than the matmuls, both under peak
    for step in MEASURED[name]:
        assert rates.seconds(measured_flops(step)) == pytest.approx(step.seconds, rel=1e-9)


# Measured steps the rates were not fitted to (docs/benchmarks.md, "Long rows"), each with the model's stated margin:
# the same kernel options as the fitting pair, or 1-2 of them off (tiles of 128: +1.8 % at 32768 tokens; no TMA: +4.7 %).
HELD_OUT = [
    (MeasuredStep("b", 1, 131072, 2048, 3.158, "2026-12-03 11:05, tiles of 128"), 0.06),
    (MeasuredStep("a", 1, 131072, 2048, 5.4529, "2026-12-03 07:39, tiles of 128, no TMA"), 0.06),
    (MeasuredStep("b", 1, 262144, 2048, 6.527, "2026-12-03 07:30, tiles of 128, no TMA"), 0.14),
    (MeasuredStep("b", 1, 32768, 2048, 0.4349, "2026-12-03 16:59", window=2048), 0.05),
    (MeasuredStep("a", 4, 3072, 512, 0.9165, "2026-12-03 14:53"), 0.02),
    # Another machine start (2026-12-05 10:19), both head dims in one run: 256 measured 1.7 % over the model, 128 at
    # the attention speedup bench/attention_ceiling.py measured at 32768 tokens 2.1 % under it.
    (MeasuredStep("b", 4, 3072, 512, 0.3926, "2026-12-05 10:19"), 0.03),
    (MeasuredStep("b", 4, 3072, 512, 0.3700, "2026-12-05 10:20, head_dim 128", head_dim=128), 0.05),
    # An H100 (2026-12-05 12:08-12:19), rates fitted on the H200: the long rows at both head dims, within 1.6 %.
    (MeasuredStep("b", 1, 32768, 2048, 1.0107, "2026-12-05 12:09, H100"), 0.03),
    (MeasuredStep("b", 1, 32768, 2048, 0.7362, "2026-12-05 12:10, H100, head_dim 128", head_dim=128), 0.03),
    (MeasuredStep("b", 1, 131072, 2048, 2.0074, "2026-12-05 12:13, H100, head_dim 128", head_dim=128), 0.03),
    (MeasuredStep("a", 1, 32768, 2048, 1.4954, "2026-12-05 12:17, H100, head_dim 128", head_dim=128), 0.03),
    (MeasuredStep("a", 1, 32768, 2048, 1.9140, "2026-12-05 12:19, H100"), 0.03),
]
# The FLASH backend's steps (H100, 2026-12-05 19:03-19:14), priced at FLASH_SPEEDUP (measured on the attention alone):
# within 2.1 %, as the Triton step of the same run (999.4 ms, 1.0 % over the model).
HELD_OUT_FLASH = [
    (MeasuredStep("b", 1, 32768, 2048, 0.7604, "2026-12-05 19:03, H100, FLASH"), 0.03),
    (MeasuredStep("b", 1, 131072, 2048, 2.1116, "2026-12-05 19:07, H100, FLASH"), 0.03),
    (MeasuredStep("b", 4, 3072, 512, 0.3703, "2026-12-05 19:14, H100, FLASH"), 0.03),
]


@pytest.mark.parametrize("step, margin", HELD_OUT, ids=lambda x: getattr(x, "measured", ""))
def test_the_rates_predict_the_measured_steps_they_were_not_fitted_to(step, margin):
    predicted = rates_at(step.drafter, step.head_dim).seconds(measured_flops(step))
    assert abs(predicted / step.seconds - 1) <= margin, (predicted, step.seconds)


@pytest.mark.parametrize("step, margin", HELD_OUT_FLASH, ids=lambda x: getattr(x, "measured", ""))
def test_the_flash_backends_speedup_predicts_its_measured_steps(step, margin):
    predicted = rates_at(step.drafter, step.head_dim, flash=True).seconds(measured_flops(step))
    assert abs(predicted / step.seconds - 1) <= margin, (predicted, step.seconds)
    assert rates_at(step.drafter, 64, flash=True) == rates_at(step.drafter, 64)  # not measured there: Triton's


def test_head_dim_128_speeds_only_the_attention_and_unmeasured_head_dims_get_256s_rate():
    at_256, at_128 = rates_at("b", 256), rates_at("b", 128)
    assert at_256 == fitted_rates("b") and at_128.matmul == at_256.matmul
    assert at_128.attention == pytest.approx(at_256.attention * ATTENTION_SPEEDUP[128]) and ATTENTION_SPEEDUP[128] > 1.5
    assert rates_at("b", 64) == at_256
    long_row = measured_flops(MeasuredStep("b", 1, 32768, 2048, 0.0, ""))
    # the attention is most of a long row's time: the 1.64x kernels take a quarter off the step
    assert 0.7 < at_128.seconds(long_row) / at_256.seconds(long_row) < 0.8


def test_window_and_length_move_the_estimate_the_way_the_pairs_do():
    full = pairs_per_anchor(uniform_contexts(32768, 16), 16, None)
    window = pairs_per_anchor(uniform_contexts(32768, 16), 16, 2048)
    assert full == pytest.approx(16 * (32768 - 16) / 2 + 256)  # mean context over the uniform anchors, and the block
    assert window < full / 7
    assert pairs_per_anchor(uniform_contexts(1024, 16), 16, 2048) == pairs_per_anchor(
        uniform_contexts(1024, 16), 16, None
    )


def test_a_drafter_is_priced_at_the_nearest_bench_drafters_rates():
    assert nearest_bench_drafter(BENCH_DRAFTERS["a"]["hidden"]) == "a"
    assert (
        nearest_bench_drafter(4096) == "a" and nearest_bench_drafter(3072) == "b" and nearest_bench_drafter(64) == "b"
    )
