"""dflash/drafter/attention.py: the defaults by head dim against torch's own kernel tables, the flags winning, the
refused-tile error, the mask function's tiles."""

import importlib.util

import pytest
import torch

from dflash.drafter import blocks
from dflash.drafter.attention import (
    CUDA_KERNEL_OPTIONS,
    attention_kernel_errors,
    attention_kernel_options,
    default_mask_tile,
    describe_choice,
    mask_function,
)
from dflash.errors import DflashError

# the compute capabilities of the GPU families in torch's tables
CUDA_CAPABILITIES = [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0)]


@pytest.mark.parametrize("capability", CUDA_CAPABILITIES)
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256, 512])
def test_default_mask_tile_divides_torchs_default_kernel_tiles(monkeypatch, capability, head_dim):
    # Inductor's flex_attention lowering refuses a BlockMask whose tiles its default kernel tiles do not divide
    # (forward: "must be divisible by BLOCK_M and BLOCK_N"; backward: no config left). Read torch's own per-GPU
    # tables, as its CUDA lowering does, for every GPU family it knows.
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    tables = CUDAConfigHeuristic()
    fwd = tables.get_flex_attn_fwd_configs(head_dim, torch.bfloat16)[-1]  # the default comes last
    bwd = tables.get_flex_attn_bwd_configs(head_dim, torch.bfloat16)[-1]
    kernel_tiles = (fwd.block_m, fwd.block_n, bwd.block_m1, bwd.block_n1, bwd.block_m2, bwd.block_n2)
    tile = default_mask_tile(head_dim)
    assert all(tile % t == 0 for t in kernel_tiles), (tile, kernel_tiles)
    # Where the default stays at torch's 128, a tile of 64 is what the H200 refused (head dims 64 and 128).
    if capability == (9, 0) and head_dim in (64, 128):
        assert tile == 128 and any(64 % t for t in kernel_tiles)


def test_the_flags_kernel_options_win_over_the_cuda_default():
    assert attention_kernel_options({}, True, 256) == CUDA_KERNEL_OPTIONS == {"bwd_num_warps": 8, "USE_TMA": True}
    assert attention_kernel_options({}, True, 128) == {}  # measured at 256 only: torch's own choices below
    assert attention_kernel_options({"bwd_num_warps": 4}, True, 128) == {"bwd_num_warps": 4}
    assert attention_kernel_options({}, False, 256) == {}
    chosen = attention_kernel_options({}, True, 256)
    chosen["USE_TMA"] = False  # a caller's copy: the default stays as measured
    assert CUDA_KERNEL_OPTIONS == {"bwd_num_warps": 8, "USE_TMA": True}


def test_the_mask_function_builds_the_chosen_tiles():
    # every tile size gives the same pairs (test_blocks); on the CPU the dense mask, which has no tiles
    anchors, valid = torch.tensor([[0, 40]]), torch.ones(1, 2, dtype=torch.bool)
    doc_ids = torch.zeros(1, 64, dtype=torch.int32)
    for tile in (16, 128):
        mask = mask_function(tile, cuda=True, compile_on=False)(anchors, valid, doc_ids, 16, None)
        assert mask.BLOCK_SIZE == (tile, tile)
    assert mask_function(16, cuda=False, compile_on=False) is blocks.dense_attention_bias


def test_the_log_line_names_where_each_choice_came_from():
    line = describe_choice({}, 128, 64, options_given=False, tile_given=False)
    assert line == (
        "attention: flex_attention on Triton kernels, options (the default at head_dim 64) torch's own; "
        "BlockMask tiles of 128 (the default at head_dim 64)"
    )
    line = describe_choice(CUDA_KERNEL_OPTIONS, 16, 256, options_given=True, tile_given=True)
    assert "(--attention-kernel-option) {'bwd_num_warps': 8, 'USE_TMA': True}" in line
    assert line.endswith("BlockMask tiles of 16 (--mask-tile-size)")
    line = describe_choice({"BACKEND": "FLASH"}, 64, 256, options_given=True, tile_given=False, kv_repeat=3)
    assert line.startswith("attention: flex_attention on flash-attn-4's CuTe kernels")
    assert line.endswith("; each K / V head repeated 3x (docs/training.md, 'Attention kernels')")
    assert "repeated" not in describe_choice({"BACKEND": "FLASH"}, 64, 256, options_given=True, tile_given=False)


def test_the_flash_backend_is_refused_where_it_cannot_run(monkeypatch):
    # before anything is built: on the CPU, and on a GPU without flash-attn-4 (this machine has no flash_attn)
    with pytest.raises(DflashError, match="BACKEND=FLASH .* on the CPU"):
        attention_kernel_options({"BACKEND": "FLASH"}, False, 256)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("flash_attn") else 1)
    with pytest.raises(DflashError, match=r"needs flash-attn-4 .* pip install -e '\.\[flash\]'"):
        attention_kernel_options({"BACKEND": "FLASH"}, True, 256)
    assert attention_kernel_options({"BACKEND": "TRITON"}, True, 256) == {"BACKEND": "TRITON"}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"BACKEND": "nonsense"}, "BACKEND='nonsense' is not one of AUTO, TRITON, FLASH, TRITON_DECODE"),
        ({"BACKEND": "flash"}, "BACKEND='flash' is not one of AUTO, TRITON, FLASH, TRITON_DECODE"),
        ({"bwd_num_warps": "eight"}, "bwd_num_warps='eight' is not an integer"),
        ({"fwd_BLOCK_M": 6.5}, "fwd_BLOCK_M=6.5 is not an integer"),
        ({"USE_TMA": 1}, "USE_TMA=1 is not true or false"),
    ],
)
def test_kernel_option_values_of_the_wrong_kind_are_refused_before_anything_is_built(options, message):
    # torch would take any of them until the step's first compile, or drop them silently
    for cuda in (True, False):
        with pytest.raises(DflashError, match=f"--attention-kernel-option {message}"):
            attention_kernel_options(options, cuda, 256)


def test_kernel_options_on_the_cpu_are_said_to_be_ignored(caplog):
    with caplog.at_level("WARNING", logger="dflash"):
        assert attention_kernel_options({"bwd_num_warps": 8}, False, 256) == {"bwd_num_warps": 8}
    assert "--attention-kernel-option bwd_num_warps=8 tunes flex_attention's CUDA kernels" in caplog.text
    assert "on the CPU" in caplog.text and "ignored" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash"):
        attention_kernel_options({"bwd_num_warps": 8}, True, 256)
        attention_kernel_options({}, False, 256)
    assert not caplog.text


def test_the_flash_kernels_refusals_name_the_flags():
    # flash-attn-4's words (4.0.0b40) for a KV tile its SM90 forward at head_dim 256 does not take, and torch 2.11's
    # for a mask op its CuTe lowering lacks (the clamp dflash.drafter.blocks no longer uses)
    refusal = (
        "LoweringException: ValueError: Block sparsity requires sparse_block_size[1] to be a multiple of tile_n=80."
    )
    with pytest.raises(DflashError, match="tiles of 128 .*tile_n=80.* Leave --mask-tile-size unset"):
        with attention_kernel_errors(128, 256, 512, 1024):
            raise RuntimeError(refusal)
    refusal = "CuteDSL template failed: ===\nUNSUPPORTED CUTEDSL OPERATION: 'minimum'\n===\nOperation: minimum\n"
    with pytest.raises(DflashError, match="cannot lower the step's attention mask .*Operation: minimum.*drop"):
        with attention_kernel_errors(64, 256, 512, 1024):
            raise RuntimeError(refusal)


def test_a_mask_tile_the_kernels_refuse_names_the_flag():
    # inductor's words when its flex_attention tiles do not divide the BlockMask's (the H200 at head_dim 64)
    refusal = "LoweringException: ValueError: Q and KV block size must be divisible by BLOCK_M and BLOCK_N. We got"
    with pytest.raises(
        DflashError, match="head_dim 64 .* tiles of 64 \\(--mask-tile-size\\); give --mask-tile-size 128"
    ):
        with attention_kernel_errors(64, 64, 512, 1024):
            raise RuntimeError(refusal)
    with pytest.raises(RuntimeError, match="something else"):  # any other failure passes unchanged
        with attention_kernel_errors(64, 64, 512, 1024):
            raise RuntimeError("something else")


def test_shapes_without_a_kernel_name_the_rows_to_change():
    # inductor's words on the H200 at head_dim 256 for the GPU test's rows of 44 block tokens (2026-12-03)
    refusal = (
        "LoweringException: NoValidChoicesError: No choices to select. Provided reason: No choices exist for "
        "backend. please consider adding ATEN into max_autotune_gemm_backends config\n  target: flex_attention"
    )
    with pytest.raises(DflashError, match="no kernel .* head_dim 256: 44 block tokens over 108 keys a row"):
        with attention_kernel_errors(64, 256, 44, 108):
            raise RuntimeError(refusal)
    with pytest.raises(RuntimeError, match="NoValidChoicesError"):  # a matmul's, not the attention's: unchanged
        with attention_kernel_errors(64, 256, 44, 108):
            raise RuntimeError("LoweringException: NoValidChoicesError: No choices to select\n  target: aten.mm")
