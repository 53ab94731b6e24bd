"""The devices a test runs on: the CPU always, CUDA where this machine has it (the GPU machine's runs)."""

import pytest
import torch

CPU_AND_CUDA = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]
