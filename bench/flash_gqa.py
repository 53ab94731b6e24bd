"""flex_attention's forward over the step's mask, Triton against BACKEND=FLASH (flash-attn-4's CuTe kernels), for
several numbers of K / V heads under the same query heads: why the trainer repeats K / V heads to a group of a
power of two under FLASH (dflash.drafter.model.flash_kv_repeat). Drafter a's attention (24 query heads of 256) and b's
(16 / 4) at 1 x 32768 tokens, 2048 anchors, BlockMask tiles of 64, random bf16 inputs, no grad.

On the GPU machine, with flash-attn-4 installed (docs/training.md, "Attention kernels"):
    python3 bench/flash_gqa.py
"""

import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's dflash

from bench.attention_ceiling import inputs  # noqa: E402
from bench.mask_tiles import row_anchors  # noqa: E402
from bench.topk import ms_per_call  # noqa: E402
from dflash.drafter import attention, blocks, graph  # noqa: E402

HEADS = ((24, 4), (24, 24), (16, 4), (24, 8), (24, 12))  # (query heads, K / V heads)
KERNELS = {"triton": attention.CUDA_KERNEL_OPTIONS, "flash": {"BACKEND": "FLASH"}}


def main():
    device = torch.device("cuda")
    anchors, valid, doc_ids = row_anchors(1, 32768, 2048, 16, 1, device)
    mask = blocks.block_attention_mask(anchors, valid, doc_ids, 16, tile_size=attention.default_mask_tile(256))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}\n")
    print("| query heads | K / V heads | per group | " + " | ".join(f"{k} fwd ms" for k in KERNELS) + " |")
    print("|---|---|---|" + "---|" * len(KERNELS))
    for heads, kv_heads in HEADS:
        times = forward_ms(mask, heads, kv_heads, device)
        cells = " | ".join(f"{t:.2f}" for t in times)
        print(f"| {heads} | {kv_heads} | {heads // kv_heads} | {cells} |", flush=True)


def forward_ms(mask, heads: int, kv_heads: int, device) -> list[float]:
    """One forward's ms under each of KERNELS, a fresh compile for this head count."""
    graph.forget_compiled_code()
    flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    q, k, v = inputs(heads, kv_heads, 32768, 65536, 256, device, torch.bfloat16)
    times = []
    for options in KERNELS.values():

        def forward(options=options):
            return flex(q, k, v, block_mask=mask, enable_gqa=kv_heads != heads, kernel_options=options)

        with torch.no_grad():
            times.append(ms_per_call(forward, 5, device))
    return times


if __name__ == "__main__":
    main()
