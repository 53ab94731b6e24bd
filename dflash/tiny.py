"""Tiny random-weight targets of the real architectures, for the smoke run and the tests.

A tiny byte-level BPE tokenizer is trained on the bundled corpus and given a Qwen-style chat template and a
`<|MASK|>` token; the model is built by transformers from a real config class and saved with `save_pretrained`,
so every consumer loads it through the real `from_pretrained` path.
"""

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CORPUS = DATA_DIR / "corpus.jsonl"
PROMPTS = DATA_DIR / "prompts.jsonl"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ARCHITECTURES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3", "qwen3_moe", "llama")


def corpus_texts(path: Path = CORPUS) -> list[str]:
    texts = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        texts.extend([m["content"] for m in record["messages"]] if "messages" in record else [record["text"]])
    return texts


def build_tokenizer(vocab_size: int = 1024, texts: list[str] | None = None):
    """A byte-level BPE tokenizer trained on `texts` (default: the bundled corpus), with a Qwen-style chat
    template and the special tokens of SPECIAL_TOKENS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus_texts() if texts is None else texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|MASK|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(arch: str, vocab_size: int, num_layers: int = 8, hidden_size: int = 64):
    """A config of the real architecture `arch`, at toy width; hybrids use 3 linear layers per full one."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    hybrid = dict(
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )
    moe = dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden_size,
        shared_expert_intermediate_size=hidden_size,
    )
    if arch == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**common, **hybrid)
    if arch == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**common, **hybrid, **moe)
    if arch == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, **hybrid, **moe)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common)
    if arch == "qwen3_moe":  # no shared expert in Qwen3-MoE
        routed = {key: value for key, value in moe.items() if key != "shared_expert_intermediate_size"}
        return transformers.Qwen3MoeConfig(**common, **routed)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")


def make_tiny_target(
    folder: Path, arch: str = "qwen3_5", seed: int = 0, num_layers: int = 8, hidden_size: int = 64
) -> Path:
    """Save a random-weight `arch` model and the tiny tokenizer to `folder` (reused if already there)."""
    return save_random_target(folder, lambda vocab: tiny_config(arch, vocab, num_layers, hidden_size), seed)


def save_random_target(folder: Path, config_for_vocab, seed: int = 0, dtype: str = "float32") -> Path:
    """Save a random-weight model of `config_for_vocab(vocabulary size)` and the tiny tokenizer to `folder`
    (reused if already there: callers put the shape in the folder's name)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    tokenizer = build_tokenizer()
    config = config_for_vocab(len(tokenizer))
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
