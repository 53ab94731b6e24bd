"""bench/mask_tiles.py's computed pairs per visible pair (the visible ones counted as MFU counts them,
dflash.drafter.flops.visible_pairs) against the brute-force dense mask's visible pairs."""

import sys
from pathlib import Path

import pytest
import torch

from dflash.drafter.blocks import dense_block_mask, sample_anchors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import mask_tiles  # noqa: E402


@pytest.mark.parametrize("block", [16, 7])
def test_the_counted_waste_equals_the_dense_masks(block):
    docs, doc_len, anchors, tile = 4, 384, 256, 128
    counted = mask_tiles.count(block, anchors, tile, docs, doc_len, seed=1)
    doc_ids = (torch.arange(docs * doc_len) // doc_len)[None]
    generator = torch.Generator().manual_seed(1)
    starts, valid = sample_anchors(torch.ones_like(doc_ids, dtype=torch.bool), doc_ids, anchors, block, generator)
    visible = int(dense_block_mask(starts, valid, doc_ids, block).sum())
    tiles = counted["partial"] + counted["full"]
    assert counted["waste"] == pytest.approx(tiles * tile * tile / visible, rel=1e-12)
    assert counted["waste"] > 1  # partial tiles compute pairs the mask hides
