"""Quantized checkpoints on the CPU: a fine-grained FP8 checkpoint (as Qwen ships: e4m3 weights in blocks, with
`weight_scale_inv` per block) loads, dequantized by transformers at load, and harvests; a format whose package is
missing is refused naming it."""

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.config import HarvestConfig
from dflash.errors import DflashError
from dflash.harvest import run_harvest
from dflash.store import Store
from dflash.target import TappedTarget, load_target
from dflash.tiny import CORPUS

BLOCK = 32  # Qwen's checkpoints use 128 x 128 blocks; the tiny target's width is 64
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = torch.randint(4, 1000, (2, 64), generator=torch.Generator().manual_seed(0))


def fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale per BLOCK x BLOCK block): weight ~ e4m3 * scale."""
    rows, columns = weight.shape
    blocks = weight.float().reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    return (blocks / scale[:, None, :, None]).reshape(rows, columns).to(torch.float8_e4m3fn), scale


def dequantized(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, columns = quantized.shape
    blocks = quantized.float().reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK) * scale[:, None, :, None]
    return blocks.reshape(rows, columns)


def save_fp8_checkpoint(source: Path, folder: Path) -> dict[str, torch.Tensor]:
    """`source` with its layers' projections in fine-grained FP8; returns their dequantized weights by name."""
    shutil.copytree(source, folder)
    tensors, weights = load_file(source / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        quantized, scale = fp8_blocks(tensors[name])
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantized, scale
        weights[name.removeprefix("model.")] = dequantized(quantized, scale)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[BLOCK, BLOCK]
    )
    (folder / "config.json").write_text(json.dumps(config))
    return weights


@pytest.fixture(scope="module")
def fp8_target(tiny_target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8") / "llama-fp8"
    return folder, save_fp8_checkpoint(tiny_target("llama"), folder)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's path: transformers dequantizes FP8 without a GPU")
def test_a_fine_grained_fp8_checkpoint_gives_its_dequantized_weights_features(fp8_target, tiny_target, caplog):
    folder, weights = fp8_target
    with caplog.at_level(logging.INFO, logger="dflash"):
        fp8 = TappedTarget(str(folder), None, "cpu", torch.float32)
    assert "fp8 weights, dequantized to float32 at load; kernels:" in caplog.text
    reference = TappedTarget(str(tiny_target("llama")), None, "cpu", torch.float32)
    unquantized = reference.features(IDS)
    state = reference.model.state_dict()
    for name in state.keys() & weights.keys():  # the truncated target holds the layers up to its last tap
        state[name].copy_(weights[name])
    features = fp8.features(IDS)
    torch.testing.assert_close(features, reference.features(IDS), atol=1e-6, rtol=1e-6)
    assert (features - unquantized).abs().max() > 1e-3  # the FP8 rounding is there: its weights were read
    model, _ = load_target(folder, "cpu")  # generation (eval, regenerate) loads it too
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's path: transformers dequantizes FP8 without a GPU")
def test_a_fine_grained_fp8_checkpoint_harvests(fp8_target, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")
    out = tmp_path / "store"
    run_harvest(HarvestConfig(model=str(fp8_target[0]), data=str(data), out=str(out), device="cpu", workers=1))
    assert Store.open(out).self_check.passed


def test_a_format_whose_package_is_missing_is_refused_naming_it(tiny_target, tmp_path):
    folder = tmp_path / "gptq"
    shutil.copytree(tiny_target("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = dict(quant_method="gptq", bits=4, group_size=128)
    (folder / "config.json").write_text(json.dumps(config))
    if importlib.util.find_spec("optimum") is not None:
        pytest.skip("optimum is installed: GPTQ may load here")
    with pytest.raises(DflashError, match=r"cannot load the gptq-quantized checkpoint .*optimum.*'Quantized"):
        TappedTarget(str(folder), None, "cpu", torch.float32)
    with pytest.raises(DflashError, match=r"cannot load the gptq-quantized checkpoint"):
        load_target(folder, "cpu")
