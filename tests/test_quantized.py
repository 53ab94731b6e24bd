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


def save_fp8_checkpoint(source: Path, folder: Path, plain: Path) -> None:
    """`source` with its layers' projections (an MoE's per expert, as Qwen ships them) in fine-grained FP8 at
    `folder`, and the same weights dequantized as a plain checkpoint at `plain`: the reference."""
    shutil.copytree(source, folder)
    shutil.copytree(source, plain)
    tensors = load_file(source / "model.safetensors")
    quantized, reference = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        weight, scale = fp8_blocks(tensors[name])
        quantized[name], quantized[name.removesuffix("weight") + "weight_scale_inv"] = weight, scale
        reference[name] = dequantized(weight, scale).to(tensors[name].dtype)
    save_file(quantized, folder / "model.safetensors", metadata={"format": "pt"})
    save_file(reference, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[BLOCK, BLOCK]
    )
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def fp8_target(tiny_target, tmp_path_factory):
    """arch -> (the FP8 checkpoint, its dequantized weights as a plain checkpoint)."""
    cache = {}

    def make(arch: str) -> tuple[Path, Path]:
        if arch not in cache:
            folder = tmp_path_factory.mktemp(f"fp8-{arch}")
            cache[arch] = folder / "fp8", folder / "dequantized"
            save_fp8_checkpoint(tiny_target(arch), *cache[arch])
        return cache[arch]

    return make


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's path: transformers dequantizes FP8 without a GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_fine_grained_fp8_checkpoint_gives_its_dequantized_weights_features(arch, fp8_target, tiny_target, caplog):
    folder, plain = fp8_target(arch)
    with caplog.at_level(logging.INFO, logger="dflash"):
        features = TappedTarget(str(folder), None, "cpu", torch.float32).features(IDS)
    assert "fp8 weights, dequantized to float32 at load; kernels:" in caplog.text
    reference = TappedTarget(str(plain), None, "cpu", torch.float32).features(IDS)
    torch.testing.assert_close(features, reference, atol=1e-6, rtol=1e-6)
    unquantized = TappedTarget(str(tiny_target(arch)), None, "cpu", torch.float32).features(IDS)
    assert (features - unquantized).abs().max() > 1e-3  # the FP8 rounding is there: its weights were read
    model, _ = load_target(folder, "cpu")  # generation (eval, regenerate) loads it too
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's path: transformers dequantizes FP8 without a GPU")
def test_a_fine_grained_fp8_checkpoint_harvests(fp8_target, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(CORPUS.read_text().splitlines()[:20]) + "\n")
    out = tmp_path / "store"
    run_harvest(
        HarvestConfig(model=str(fp8_target("qwen3_moe")[0]), data=str(data), out=str(out), device="cpu", workers=1)
    )
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
