import pytest
import torch

from dflash.tiny import make_tiny_target

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """Factory: a saved random-weight target of a real architecture, built once per session and arch."""
    cache = {}

    def make(arch: str = "qwen3_5", **kwargs):
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"target-{arch}")
            cache[key] = make_tiny_target(folder, arch, **kwargs)
        return cache[key]

    return make
