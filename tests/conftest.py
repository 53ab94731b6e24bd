import pytest
import torch

from dflash.tiny import build_tokenizer, make_tiny_target

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


def _save_tokenizer(folder, template=None) -> str:
    """dflash.tiny's tokenizer saved to `folder`, with another chat template when given; the folder's path."""
    tokenizer = build_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def save_tokenizer():
    """Factory: (folder, template=None) -> the path of dflash.tiny's tokenizer saved there, with that template."""
    return _save_tokenizer


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    return _save_tokenizer(tmp_path_factory.mktemp("tokenizer"))
