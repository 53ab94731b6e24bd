"""The device and dtype every command runs on, resolved in one place (torch only)."""

import os

import torch

from dflash.errors import DflashError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def local_device(requested: str | torch.device | None = None) -> torch.device:
    """This process's device: the requested one, else cuda:$LOCAL_RANK when CUDA is there, else the CPU.

    None and "auto" ask for that default. A bare "cuda" also means this process's own GPU (LOCAL_RANK under
    torchrun), never GPU 0 for every rank; an explicit index is kept.
    """
    if requested == "auto":
        requested = None
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))
    device = torch.device("cuda", local) if device.type == "cuda" and device.index is None else device
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise DflashError(
            f"device {device} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s) "
            f"(torch {torch.__version__}); use --device cpu, or fewer processes per node"
        )
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A dtype name (or dtype) as a torch dtype; "auto" is bfloat16 on CUDA, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise DflashError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]
