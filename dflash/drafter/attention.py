"""Which flex_attention kernels a training step runs on CUDA: the kernel options and the BlockMask's tiles, chosen
by the drafter's head dim where the flags give none, and torch's refusal of a tile turned into the flag to change.

The defaults were measured at head_dim 256 (Qwen3.5's drafters) on the H200 (docs/training.md, "Attention
kernels"); other head dims run torch's own kernels, whose tiles they must fit.
"""

import contextlib
import functools
import importlib.util
import logging
import typing

from torch.nn.attention.flex_attention import FlexKernelOptions

from dflash.drafter.blocks import MASK_COMPILE_OPTIONS, TORCH_MASK_TILE, block_attention_mask, dense_attention_bias
from dflash.drafter.graph import compile_fn
from dflash.errors import DflashError

logger = logging.getLogger("dflash")

# flex_attention's options on CUDA when --attention-kernel-option gives none: the backward on 8 warps (half the dK /
# dV accumulator registers per thread at head_dim 256) was faster for both bench drafters at 4 x 3072 and at long
# rows on the H200, and TMA loads on top of it faster at 1 x 32768 and the same at 4 x 3072 (docs/benchmarks.md,
# "Long rows"); torch's own choice is bwd_num_warps=4 without TMA. torch turns USE_TMA off where the device or the
# tensors cannot use it (before Hopper).
CUDA_KERNEL_OPTIONS = {"bwd_num_warps": 8, "USE_TMA": True}
# BlockMask tiles of 64 skip more of the mask than torch's 128: measured faster at head_dim 256 for every method
# and row shape (docs/training.md).
SMALL_MASK_TILE = 64
# The head dims from which torch's default flex_attention kernels are the ones both defaults were measured on, at
# 256: at most 64 wide on every CUDA GPU, so they divide a mask of 64-tiles. At 64 and 128 its Hopper and
# Blackwell kernels are 128 wide and refuse one (tests/test_attention_kernels.py reads torch's tables); below
# this head dim the step runs torch's own options and tiles.
TUNED_MIN_HEAD_DIM = 193


# flex_attention's experimental backend on flash-attn-4's CuTe kernels (`--attention-kernel-option BACKEND=FLASH`):
# at head_dim 256 on an H100 its forward and backward each ran 1.5x as fast as Triton's over the step's mask
# (docs/benchmarks.md, "Long rows", 2026-12-05). Opt-in: a beta package, measured on one GPU type.
FLASH_EXTRA = "pip install -e '.[flash]' ('.[flash-cu13]' for a CUDA 13 build of torch)"


def uses_flash(options: dict | None) -> bool:
    return (options or {}).get("BACKEND") == "FLASH"


def check_flash(cuda: bool) -> None:
    """Refuse BACKEND=FLASH where it cannot run, before anything is built, and import its kernels' package now
    rather than in the step's first compile (torch's template imports it there): a pointwise step recompiled once
    on an H100 after torch's pytree registry grew during that compile (cause not pinned down; docs/benchmarks.md).
    Should it recur, the recompile's error names the types registered (graph.no_recompiles): import their module
    here."""
    if not cuda:
        raise DflashError(
            "--attention-kernel-option BACKEND=FLASH runs flash-attn-4's CUDA kernels, and this run is on the CPU "
            "(its attention is a dense mask): drop the option"
        )
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        raise DflashError(
            "--attention-kernel-option BACKEND=FLASH needs flash-attn-4 (its CuTe kernels), which is not installed: "
            f"{FLASH_EXTRA} (docs/training.md, 'Attention kernels'), or drop the option for flex_attention's "
            "Triton kernels"
        )
    importlib.import_module("flash_attn.cute.interface")


def check_kernel_options(options: dict) -> None:
    """Refuse keys that torch's flex_attention does not know, and values not of their key's kind: Triton would
    ignore a misspelt tile size silently, and torch takes any BACKEND until the step's first compile."""
    kinds = typing.get_type_hints(FlexKernelOptions)
    unknown = sorted(k for k in options if k.removeprefix("fwd_").removeprefix("bwd_") not in kinds)
    if unknown:
        raise DflashError(
            f"unknown flex_attention kernel option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in "
            f"--attention-kernel-option; the options are {', '.join(sorted(kinds))}, optionally prefixed fwd_ or bwd_"
        )
    for key, value in options.items():
        kind = kinds[key.removeprefix("fwd_").removeprefix("bwd_")]
        if typing.get_origin(kind) is typing.Literal:
            ok, want = value in typing.get_args(kind), f"one of {', '.join(typing.get_args(kind))}"
        elif kind is bool:
            ok, want = isinstance(value, bool), "true or false"
        else:  # the tiles, warps and stages
            ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
        if not ok:
            raise DflashError(f"--attention-kernel-option {key}={value!r} is not {want}; give {key} {want}")


def attention_kernel_options(given: dict, cuda: bool, head_dim: int) -> dict:
    """The drafter's flex_attention options: the flags' when given, else the CUDA default where it was measured
    (the CPU's flex_attention evaluates the mask densely and takes none)."""
    if given:
        check_kernel_options(given)
        if uses_flash(given):
            check_flash(cuda)
        elif not cuda:  # kept (they cannot change a value), but the run should not pass for a tuned one
            shown = " ".join(f"{key}={value}" for key, value in given.items())
            logger.warning(
                "--attention-kernel-option %s tunes flex_attention's CUDA kernels; on the CPU the attention is a "
                "dense mask, which takes no kernel options: ignored",
                shown,
            )
        return dict(given)
    return dict(CUDA_KERNEL_OPTIONS) if cuda and head_dim >= TUNED_MIN_HEAD_DIM else {}


def default_mask_tile(head_dim: int) -> int:
    """The BlockMask tile of TrainConfig.mask_tile_size = None: small where torch's kernels allow it."""
    return SMALL_MASK_TILE if head_dim >= TUNED_MIN_HEAD_DIM else TORCH_MASK_TILE


def mask_tile(given: int | None, cuda: bool, head_dim: int) -> int:
    """The step's BlockMask tile: `--mask-tile-size` when given, else the default; a tile given on the CPU is
    named as unused there (its attention is a dense mask) rather than passed over in silence."""
    if given is not None and not cuda:
        logger.warning(
            "--mask-tile-size %d tiles the BlockMask of flex_attention's CUDA kernels; on the CPU the attention is a "
            "dense mask, which has no tiles: ignored",
            given,
        )
    return given or default_mask_tile(head_dim)


def describe_choice(
    options: dict, tile: int, head_dim: int, options_given: bool, tile_given: bool, kv_repeat: int = 1
) -> str:
    """The log line's account of the step's kernels and where each choice came from (`kv_repeat`: the drafter's
    dflash.drafter.model.flash_kv_repeat, above 1 under FLASH only)."""
    by_head_dim = f"the default at head_dim {head_dim}"
    options_from = "--attention-kernel-option" if options_given else by_head_dim
    tile_from = "--mask-tile-size" if tile_given else by_head_dim
    shown = options or "torch's own"
    kernels = "flash-attn-4's CuTe kernels" if uses_flash(options) else "Triton kernels"
    line = f"attention: flex_attention on {kernels}, options ({options_from}) {shown}; BlockMask tiles of {tile} ({tile_from})"
    if kv_repeat > 1:  # its forward: 3.9x Triton's time at 3 or 6 query heads a K / V head
        line += f"; each K / V head repeated {kv_repeat}x (docs/training.md, 'Attention kernels')"
    return line


def mask_function(tile_size: int, cuda: bool, compile_on: bool):
    """(anchors, valid, doc ids, block size, window) -> the step's attention mask. On a GPU a BlockMask of
    `tile_size` tiles; on the CPU the dense mask (flex_attention has no CPU backward), built directly as the
    bias every layer shares, not through a BlockMask's mask_mod (13 bytes a pair while it is evaluated)."""
    if not cuda:
        return dense_attention_bias
    block_mask = functools.partial(block_attention_mask, tile_size=tile_size)
    return compile_fn(block_mask, compile_on, options=MASK_COMPILE_OPTIONS)


@contextlib.contextmanager
def attention_kernel_errors(tile_size: int, head_dim: int, query_tokens: int, key_tokens: int):
    """inductor's refusals of the step's flex_attention, at its first compile, turned into the flags to change: a
    BlockMask whose tiles its kernels' tiles do not divide, or shapes for which it has no kernel at all."""
    try:
        yield
    except Exception as exc:
        text = str(exc)
        if "must be divisible by BLOCK_M and BLOCK_N" in text:
            raise DflashError(
                f"flex_attention's kernels at head_dim {head_dim} on this GPU use tiles that do not divide the "
                f"attention mask's tiles of {tile_size} (--mask-tile-size); give --mask-tile-size 128, or leave it "
                "unset (it then follows the head dim), or set kernel tiles that divide it with "
                "--attention-kernel-option fwd_BLOCK_M=... (docs/training.md, 'Attention kernels')"
            ) from exc
        if "Block sparsity requires" in text:  # flash-attn-4's kernels: the mask's tiles must fit theirs
            raise DflashError(
                f"flash-attn-4's kernels at head_dim {head_dim} do not take the attention mask's tiles of {tile_size} "
                f"(--mask-tile-size): {text.splitlines()[-1].strip()} Leave --mask-tile-size unset (it then follows "
                "the head dim: 64 at 256, 128 at 128) or drop --attention-kernel-option BACKEND=FLASH"
            ) from exc
        if "UNSUPPORTED CUTEDSL OPERATION" in text:
            raise DflashError(
                "flex_attention's FLASH backend cannot lower the step's attention mask with this torch ("
                f"{next((line.strip() for line in text.splitlines() if line.startswith('Operation:')), 'an operation')}"
                "): drop --attention-kernel-option BACKEND=FLASH for its Triton kernels"
            ) from exc
        if "NoValidChoicesError" in text and "flex_attention" in text:
            raise DflashError(
                f"flex_attention has no kernel on this GPU for the step's attention at head_dim {head_dim}: "
                f"{query_tokens} block tokens over {key_tokens} keys a row (torch's Triton templates found no valid "
                "configuration; on an H200 at head_dim 256 there is none for 64 over 128, there is from 512 over "
                "1024). Train from rows of more tokens (a store of a longer --token-budget) with more --anchors "
                "(docs/training.md, 'Attention kernels')"
            ) from exc
        raise
