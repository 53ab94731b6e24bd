"""How much of the attention kernel's work a step's BlockMask wastes: the (query tile, key tile) pairs that
flex_attention computes (partial tiles evaluate the mask, full ones skip it) against the (query, key) pairs the mask
lets through, for each block size, anchor count and tile size. Exact counts from dflash.drafter.blocks on the CPU (no
timing), at bench/train.py's row of 4 documents x 3072 tokens by default.

    python bench/mask_tiles.py                                   # DFlash (16), DSpark (7), DFlash 2 block 8
    python bench/mask_tiles.py --blocks 7 --anchors 2048,4680 --tiles 128,64
"""

import argparse

import torch

from dflash.drafter import blocks
from dflash.drafter.flops import visible_pairs


def row_anchors(docs: int, doc_len: int, anchors: int, block: int, seed: int, device="cpu"):
    """One row of `docs` documents of `doc_len` tokens, the loss on every token, and its `anchors` drawn with
    `seed` as the trainer draws them: (anchors [1, A], valid [1, A], doc ids [1, T])."""
    T = docs * doc_len
    doc_ids = (torch.arange(T, device=device) // doc_len)[None]
    loss_mask = torch.ones(1, T, dtype=torch.bool, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    return (*blocks.sample_anchors(loss_mask, doc_ids, anchors, block, generator), doc_ids)


def count(block: int, anchors: int, tile: int, docs: int, doc_len: int, seed: int) -> dict:
    starts, valid, doc_ids = row_anchors(docs, doc_len, anchors, block, seed)
    mask = blocks.block_attention_mask(starts, valid, doc_ids, block, tile_size=tile)
    partial, full = int(mask.kv_num_blocks.sum()), int(mask.full_kv_num_blocks.sum())
    visible = int(visible_pairs(starts, valid, doc_ids, block))  # the pairs MFU counts
    return {"partial": partial, "full": full, "waste": (partial + full) * tile * tile / visible}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="16,7,8", help="block sizes (queries per anchor)")
    parser.add_argument("--anchors", default="2048", help="anchors per row")
    parser.add_argument("--tiles", default="128,64", help="BlockMask tile sizes")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"rows of {args.docs} x {args.doc_len} tokens, anchors drawn with seed {args.seed}\n")
    print("| block | anchors | tile | tiles computed | of them partial | computed pairs / visible pairs |")
    print("|---|---|---|---|---|---|")
    for block in map(int, args.blocks.split(",")):
        for anchors in map(int, args.anchors.split(",")):
            for tile in map(int, args.tiles.split(",")):
                c = count(block, anchors, tile, args.docs, args.doc_len, args.seed)
                total = c["partial"] + c["full"]
                print(
                    f"| {block} | {anchors} | {tile} | {total} | {c['partial']} ({100 * c['partial'] / total:.0f} %) "
                    f"| {c['waste']:.3f} |"
                )


if __name__ == "__main__":
    main()
