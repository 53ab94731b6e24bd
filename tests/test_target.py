"""TappedTarget against transformers' own forward of each document alone, and the checkpoint readers.

Tolerance: float32 on CPU, atol = rtol = 1e-5. The tiny random-weight targets' features reach ~0.1; a padded row
differs from the standalone forward by <1e-7 (rounding only), while leaking padding or another document moves
them by >0.03: the leakage tests below show the same comparison failing for left padding and for packing.
"""

import logging

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from dflash.errors import DflashError
from dflash.kernels import describe_kernels
from dflash.target import TappedTarget, check_layer_ids, default_layer_ids
from dflash.target_files import load_embedding_and_head
from dflash.tiny import build_tokenizer, tiny_config

ATOL = RTOL = 1e-5
LENGTHS = (3, 40, 200)
PAD_ID = 0


def _documents(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 1000, (n,), generator=generator) for n in LENGTHS]


def _right_padded(documents: list[torch.Tensor]) -> torch.Tensor:
    rows = torch.full((len(documents), max(len(d) for d in documents)), PAD_ID)
    for row, document in zip(rows, documents):
        row[: len(document)] = document
    return rows


@torch.inference_mode()
def _standalone(model, document: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """transformers' own forward of one document alone: layer k's output is hidden_states[k + 1]."""
    hidden_states = model(document[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden_states[k + 1][0] for k in layer_ids], dim=-1)


@pytest.fixture(scope="module")
def reference(tiny_target):
    cache = {}

    def load(arch: str):
        if arch not in cache:
            cache[arch] = AutoModelForCausalLM.from_pretrained(tiny_target(arch), dtype=torch.float32).eval()
        return cache[arch]

    return load


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_features_of_a_padded_batch_equal_standalone_forwards(tiny_target, reference, arch):
    target = TappedTarget(str(tiny_target(arch)), None, "cpu", torch.float32)
    documents = _documents()
    features = target.features(_right_padded(documents))
    assert features.shape == (3, max(LENGTHS), 5 * target.info.hidden_size)
    for row, document in zip(features, documents):
        expected = _standalone(reference(arch), document, target.layer_ids)
        torch.testing.assert_close(row[: len(document)], expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_the_comparison_catches_leakage(tiny_target, reference, arch):
    """Left padding (padding before the document) and packing without isolation both change the features."""
    target = TappedTarget(str(tiny_target(arch)), [1, 5], "cpu", torch.float32)
    short, long = _documents()[1:]
    expected = _standalone(reference(arch), short, target.layer_ids)
    left_padded = torch.cat([torch.full((len(long),), PAD_ID), short])
    packed = torch.cat([long, short])
    leaky = target.features(torch.stack([left_padded, packed]))
    for row in leaky:
        assert (row[-len(short) :] - expected).abs().max() > 100 * ATOL


def test_layers_after_the_last_tapped_one_are_not_loaded(tiny_target, reference):
    target = TappedTarget(str(tiny_target("qwen3_5")), [0, 2], "cpu", torch.float32)
    names = {name for name, _ in target.model.named_parameters()}
    assert {name.split(".")[1] for name in names if name.startswith("layers.")} == {"0", "1", "2"}
    assert not any(name.startswith(("lm_head", "norm")) for name in names)
    assert isinstance(target.model.norm, torch.nn.Identity)
    full = reference("qwen3_5").model
    kept = [full.embed_tokens, *full.layers[:3]]
    assert sum(p.numel() for p in target.model.parameters()) == sum(p.numel() for m in kept for p in m.parameters())
    assert sum(p.numel() for p in target.model.parameters()) < 0.6 * sum(
        p.numel() for p in reference("qwen3_5").parameters()
    )


def test_default_layer_rule():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_layer_ids(8) == [1, 2, 3, 4, 5]
    assert default_layer_ids(36, n=3) == [1, 17, 33]
    with pytest.raises(DflashError, match="--layers"):
        default_layer_ids(6)


@pytest.mark.parametrize(
    "layers, problem", [([0, 8], "outside"), ([2, 2], "duplicates"), ([3, 1], "increasing"), ([], "0..7")]
)
def test_bad_layer_lists_name_the_valid_range(tiny_target, layers, problem):
    with pytest.raises(DflashError, match=problem) as error:
        TappedTarget(str(tiny_target("qwen3")), layers, "cpu", torch.float32)
    assert "0..7" in str(error.value)
    assert check_layer_ids([0, 7], 8) == [0, 7]


def test_info_and_kernel_log_on_cpu(tiny_target, caplog):
    with caplog.at_level(logging.INFO, logger="dflash"):
        target = TappedTarget(str(tiny_target("qwen3_5")), None, "cpu", torch.float32)
    assert target.kernels == {
        "attention": "sdpa",
        "gated_delta_rule": "torch-reference",
        "causal_conv1d": "torch-reference",
    }
    assert "gated_delta_rule torch-reference" in caplog.text and "attention sdpa" in caplog.text
    assert (target.info.num_layers, target.info.hidden_size, target.info.vocab_size) == (8, 64, 1024)
    assert len(target.info.config_hash) == 64


def test_the_kernel_log_says_why_the_reference_code_runs_where_it_runs():
    """On the CPU the reference code is the right path; on a GPU it names the package that is missing (the H100's
    regenerate, 2026-12-05, ran its convs on the reference code and was told it was the right path on a CPU)."""
    cpu = describe_kernels({"gated_delta_rule": "torch-reference"}, torch.device("cpu"))
    assert "the right path on a CPU" in cpu
    decode = {"gated_delta_rule": "fla", "causal_conv1d": "torch-reference", "causal_conv1d_update": "torch-reference"}
    gpu = describe_kernels(decode, torch.device("cuda"))
    assert "CPU" not in gpu and "causal_conv1d, causal_conv1d_update on the GPU: causal-conv1d is not installed" in gpu
    delta = describe_kernels({"gated_delta_rule": "torch-reference"}, torch.device("cuda"))
    assert "flash-linear-attention is not installed" in delta
    assert describe_kernels({"attention": "sdpa"}, torch.device("cuda")) == "attention sdpa"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without fla")
def test_hybrid_on_slow_kernels_is_refused_on_cuda(tiny_target):
    """The refusal comes before any CUDA work, so it is checked on a CPU machine too."""
    with pytest.raises(DflashError, match=r"pip install 'dflash\[gpu\]'.*--allow-slow-kernels"):
        TappedTarget(str(tiny_target("qwen3_5")), None, "cuda", torch.float32)


def test_missing_model_folder(tmp_path):
    with pytest.raises(DflashError, match="--model"):
        TappedTarget(str(tmp_path / "nowhere"), None, "cpu", torch.float32)


def _save(model, tokenizer, folder, **kwargs):
    model.save_pretrained(folder, **kwargs)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_embedding_and_head_untied(tiny_target, reference):
    embed, head = load_embedding_and_head(str(tiny_target("qwen3")))
    model = reference("qwen3")
    assert not torch.equal(embed, head)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)


def test_embedding_and_head_tied_and_sharded(tmp_path):
    tokenizer = build_tokenizer()
    config = tiny_config("qwen3", len(tokenizer), num_layers=2)
    config.tie_word_embeddings = True
    model = transformers.Qwen3ForCausalLM(config)
    path = _save(model, tokenizer, tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    embed, head = load_embedding_and_head(path)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)


def test_vl_style_checkpoint(tmp_path):
    """A Qwen3.5 checkpoint as published: a text_config, `model.language_model.` keys, a vision tower."""
    tokenizer = build_tokenizer()
    text_config = tiny_config("qwen3_5", len(tokenizer), num_layers=4).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.Qwen3_5Config(text_config=text_config, vision_config=vision, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    path = _save(model, tokenizer, tmp_path)
    target = TappedTarget(path, [0, 2], "cpu", torch.float32)
    assert target.info.model_type == "qwen3_5" and not any("visual" in n for n, _ in target.model.named_parameters())
    documents = _documents()[:2]
    features = target.features(_right_padded(documents))
    for row, document in zip(features, documents):
        torch.testing.assert_close(row[: len(document)], _standalone(model, document, [0, 2]), atol=ATOL, rtol=RTOL)
    embed, head = load_embedding_and_head(path)
    assert torch.equal(embed, model.get_input_embeddings().weight) and torch.equal(head, embed)


def test_reading_the_embedding_and_head_loads_no_modeling_code(tiny_target):
    """Training reads two tensors and the config's hash from the target's files, never a model implementation."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from dflash.target_files import config_hash, load_embedding_and_head\n"
        f"load_embedding_and_head({str(tiny_target('qwen3'))!r}); config_hash({str(tiny_target('qwen3'))!r})\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers') and 'modeling' in m))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with fla installed")
def test_fla_kernels_on_gpu(tiny_target, reference):
    """On CUDA the hybrid runs fla's GDN and Triton conv; bf16 features stay close to the float32 reference."""
    from dflash.kernels import _fla_causal_conv1d_fn

    target = TappedTarget(str(tiny_target("qwen3_5")), None, "cuda", torch.bfloat16)
    assert target.kernels == {"attention": "sdpa", "gated_delta_rule": "fla", "causal_conv1d": "fla-triton"}
    x = torch.randn(2, 50, 96, device="cuda").transpose(1, 2)  # the [B, D, T] view transformers passes
    weight, bias = torch.randn(96, 4, device="cuda"), torch.randn(96, device="cuda")
    expected = torch.nn.functional.silu(
        torch.nn.functional.conv1d(x, weight[:, None], bias, padding=3, groups=96)[..., :50]
    )
    torch.testing.assert_close(_fla_causal_conv1d_fn(x, weight, bias, "silu"), expected, atol=1e-4, rtol=1e-4)
    documents = _documents()
    features = target.features(_right_padded(documents).cuda()).float().cpu()
    for row, document in zip(features, documents):
        expected = _standalone(reference("qwen3_5"), document, target.layer_ids)
        torch.testing.assert_close(row[: len(document)], expected, atol=0.05, rtol=0.05)


def test_a_missing_gpu_is_a_clear_error(monkeypatch):
    from dflash.device import local_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")  # a third process per node on a machine of two GPUs
    with pytest.raises(DflashError, match="cuda:2 asked for, but this machine has 2 CUDA device"):
        local_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DflashError, match="use --device cpu"):
        local_device("cuda:0")


def test_local_device_is_this_ranks_gpu(monkeypatch):
    """Under torchrun every rank must land on its own GPU, whether --device is left out or given as a bare cuda."""
    from dflash.device import local_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert local_device("cuda") == torch.device("cuda", 3)
    assert local_device("cuda:1") == torch.device("cuda", 1)  # an explicit index is kept
    assert local_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert local_device(None) == local_device("auto") == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device(None) == local_device("auto") == torch.device("cpu")


def test_generation_on_the_cpu_keeps_gpu_kernels_for_cuda_tensors(tiny_target, monkeypatch, caplog):
    """Where fla is installed transformers binds its Triton kernels, which fail on CPU tensors: a hybrid target
    loaded for generation on the CPU sends every hybrid function's CPU calls, decoding included, to the reference."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    from dflash.evaluate.decoding import plain_greedy
    from dflash.kernels import DECODE_FUNCTIONS, SEQUENCE_FUNCTIONS
    from dflash.regenerate import encode_prompt, eos_token_ids
    from dflash.target import load_target

    path = tiny_target("qwen3_5")
    target, tokenizer = load_target(path, "cpu", "float32")
    prompt = torch.tensor(encode_prompt(tokenizer, {"prompt": "def parse(line):\n    return"}))
    expected = plain_greedy(target, prompt, 12, eos_token_ids(target, tokenizer)).tokens
    called, kernels = [], {}
    for name in {**SEQUENCE_FUNCTIONS, **DECODE_FUNCTIONS}.values():

        def triton_kernel(*args, _name=name, **kwargs):
            called.append(_name)
            raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

        triton_kernel.__wrapped__ = inspect.unwrap(getattr(modeling, name))
        kernels[name] = triton_kernel
        monkeypatch.setattr(modeling, name, triton_kernel)
    with caplog.at_level(logging.INFO, logger="dflash"):
        target, tokenizer = load_target(path, "cpu", "float32")
    assert plain_greedy(target, prompt, 12, eos_token_ids(target, tokenizer)).tokens == expected
    assert called == [] and "recurrent_gated_delta_rule torch-reference" in caplog.text
    assert all(
        getattr(modeling, name).fast is kernel for name, kernel in kernels.items()
    )  # CUDA tensors still go there
