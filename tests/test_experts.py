"""An MoE target's experts implementation: the fastest for the device unless the user names one, said in the
log's `kernels:` line; every implementation's features equal eager's (float32 on the CPU, atol = rtol = 1e-5:
they differ by the order of the experts' sums, ~3e-6 on these tiny targets)."""

import logging

import pytest
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from dflash import kernels
from dflash.config import EXPERTS_IMPLEMENTATIONS, HarvestConfig
from dflash.errors import DflashError
from dflash.target import TappedTarget, load_target

MOE_ARCHITECTURES = ["qwen3_moe", "qwen3_5_moe", "qwen3_next"]
IDS = torch.randint(4, 1000, (2, 96), generator=torch.Generator().manual_seed(0))


def test_the_names_are_transformers():
    assert set(EXPERTS_IMPLEMENTATIONS) == {"eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()}


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_every_implementation_gives_eagers_features_and_is_logged(arch, tiny_target, caplog):
    def features(experts: str) -> torch.Tensor:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dflash"):
            target = TappedTarget(str(tiny_target(arch)), None, "cpu", torch.float32, experts=experts)
        assert f"experts {target.kernels['experts']}" in caplog.text
        return target.kernels["experts"], target.features(IDS)

    chosen, auto = features("auto")
    assert chosen == "grouped_mm"  # torch >= 2.9 runs it on the CPU
    eager = features("eager")[1]
    torch.testing.assert_close(auto, eager, atol=1e-5, rtol=1e-5)
    for name in ("grouped_mm", "batched_mm"):
        got, values = features(name)
        assert got == name
        torch.testing.assert_close(values, eager, atol=1e-5, rtol=1e-5)


def test_generation_gets_the_fastest_too(tiny_target, caplog):
    with caplog.at_level(logging.INFO, logger="dflash"):
        model, _ = load_target(tiny_target("qwen3_moe"), "cpu")
    assert model.config._experts_implementation == "grouped_mm" and "experts grouped_mm" in caplog.text


def test_a_dense_target_has_no_experts_entry(tiny_target):
    target = TappedTarget(str(tiny_target("llama")), None, "cpu", torch.float32, experts="eager")
    assert "experts" not in target.kernels


def test_an_unknown_name_is_refused_before_loading(tiny_target, tmp_path):
    with pytest.raises(DflashError, match=r"unknown experts implementation 'fast'.*auto.*grouped_mm"):
        TappedTarget(str(tmp_path / "absent"), None, "cpu", torch.float32, experts="fast")
    with pytest.raises(DflashError, match=r"unknown experts implementation 'fast'"):
        load_target(tiny_target("qwen3_moe"), "cpu", experts="fast")


@pytest.mark.parametrize(
    ("capability", "expected"), [((9, 0), "grouped_mm"), ((8, 0), "grouped_mm"), ((7, 5), "eager")]
)
def test_on_cuda_grouped_mm_needs_sm80(capability, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert kernels.fastest_experts(torch.device("cuda", 0)) == expected


def test_the_harvest_cli_refuses_an_unknown_name(tmp_path):
    from click.testing import CliRunner

    from cli.main import main

    result = CliRunner().invoke(main, ["harvest", "--model", "m", "--data", "d", "--out", "o", "--experts", "fast"])
    assert result.exit_code != 0 and "'fast' is not one of 'auto', 'eager', 'grouped_mm'" in result.output
    assert HarvestConfig(model="m", data="d", out="o").experts == "auto"
