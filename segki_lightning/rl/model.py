"""The policy: a local Hugging Face checkpoint (weights + tokenizer, no remote code) or the embedded tiny
Qwen3.5 hybrid (3 Gated-DeltaNet + 1 full-attention layer), randomly initialised."""
from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def tiny_qwen35(vocab_size: int, pad_token_id: int, eos_token_id: int, hidden_size: int = 64,
                num_layers: int = 4, dtype: str = "float32", seed: int = 0):
    """A small Qwen3.5 text model: every 4th layer full attention, the rest Gated DeltaNet."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    heads = max(2, hidden_size // 32)
    cfg = Qwen3_5TextConfig(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden_size // heads,
        linear_num_key_heads=heads // 2 or 1, linear_num_value_heads=heads, linear_key_head_dim=hidden_size // heads,
        linear_value_head_dim=hidden_size // heads, vocab_size=vocab_size, pad_token_id=pad_token_id,
        eos_token_id=eos_token_id, bos_token_id=None, tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)])
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(cfg).to(_dtype(dtype))


def load_pretrained(path: str, dtype: str = "bfloat16"):
    """``(model, tokenizer)`` from a local folder with safetensors weights and a tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model.pretrained={path} is not a local folder: point it at a checkpoint saved "
                                "with save_pretrained (nothing is downloaded)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(dtype), trust_remote_code=False,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
