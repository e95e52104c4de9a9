"""The policy: a Hugging Face checkpoint, local or a Hub id (weights + tokenizer, no remote code) or the embedded tiny
Qwen3.5 hybrid (3 Gated-DeltaNet + 1 full-attention layer), randomly initialised."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("segki_lightning")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str) -> torch.dtype:
    """``model.dtype``'s torch dtype; ``auto`` (a checkpoint's own) is float32 for the embedded model."""
    if name == "auto":
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
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


def load_pretrained(name_or_path: str, dtype: str = "auto", revision: str | None = None):
    """``(model, tokenizer)`` from a local folder saved with ``save_pretrained`` or a Hub model id (downloaded into
    the Hub cache as transformers does, or read from it offline); no remote code. ``dtype="auto"`` keeps the
    checkpoint's own dtype; another one casts, with a line saying so."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = resolve_checkpoint(name_or_path, revision)
    stored = getattr(AutoConfig.from_pretrained(folder, local_files_only=True), "dtype", None)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    want = "auto" if dtype == "auto" else _dtype(dtype)
    if want != "auto" and stored is not None and want != stored:
        log.info("segki: model.dtype=%s casts %s's %s weights", dtype, name_or_path, stored)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=want, trust_remote_code=False, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


# what a causal LM checkpoint needs from a Hub repository (weights, configs, tokenizer, chat template)
_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def hub_offline() -> bool:
    """Whether the Hub is off limits: ``HF_HUB_OFFLINE`` as huggingface_hub read it at import, or as set since."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def resolve_checkpoint(name_or_path: str, revision: str | None = None, setting: str = "model.pretrained",
                       revision_setting: str = "model.revision") -> str:
    """A local folder as it is; else a Hub model id's snapshot folder in the Hub cache (fetched when missing, unless
    offline: ``HF_HUB_OFFLINE=1``). Either way one clear error naming ``setting`` (and ``revision_setting``) when it
    is neither."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    if Path(name_or_path).is_dir():
        return name_or_path
    offline = hub_offline()
    try:
        return snapshot_download(name_or_path, revision=revision, allow_patterns=_CHECKPOINT_FILES,
                                 local_files_only=offline)
    except HFValidationError:
        raise FileNotFoundError(f"{setting}={name_or_path} is neither a local folder nor a Hub model id "
                                "(org/name)") from None
    except Exception as err:   # not in the cache offline, no network, no such repository or revision
        where = "the local Hub cache (HF_HUB_OFFLINE=1)" if offline else "the Hub"
        raise FileNotFoundError(f"{setting}={name_or_path}"
                                f"{f' ({revision_setting}={revision})' if revision else ''} is not a local folder and "
                                f"could not be had from {where}: {type(err).__name__}: {str(err)[:300]}") from None
