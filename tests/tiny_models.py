"""Tiny models built from configs (no downloads), saved and reloaded through ``from_pretrained`` so the
real loading code runs. Norm weights and projections get non-trivial random values so that every form
(``w`` vs ``1 + w``) and path is actually exercised."""
from __future__ import annotations

import torch

VOCAB = 97


def qwen35_config(**overrides):
    from transformers import Qwen3_5TextConfig

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=VOCAB,
              layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0, eos_token_id=1,
              bos_token_id=None, tie_word_embeddings=True)
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


def llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    kw.update(overrides)
    return LlamaConfig(**kw)


def qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1,
              bos_token_id=None)
    kw.update(overrides)
    return Qwen3Config(**kw)


def gemma_config(**overrides):
    from transformers import GemmaConfig

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1,
              bos_token_id=None, hidden_activation="gelu_pytorch_tanh")
    kw.update(overrides)
    return GemmaConfig(**kw)


CONFIGS = {"qwen3_5": qwen35_config, "llama": llama_config, "qwen3": qwen3_config, "gemma": gemma_config}


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every parameter O(1)-scaled random values (norm weights around their identity)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if "norm" in name and p.mean() > 0.5 else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model


def build_model(family: str, tmp_path, seed: int | None = None, dtype=torch.float32, **overrides):
    """A fresh random model of ``family``, round-tripped through save_pretrained/from_pretrained."""
    from transformers import AutoModelForCausalLM

    seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](**overrides))
    randomize_(model, seed)
    path = tmp_path / f"{family}-{seed}"
    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def padded_batch(batch: int = 3, length: int = 11, seed: int | None = None):
    """``input_ids [B, T]`` and a left-padded ``attention_mask [B, T]`` (row b has b*3 pads)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ())))
    ids = torch.randint(2, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : min(3 * b, length - 1)] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask




def decode_bookkeeping(rows: int, cols: int, eos=(5, 9), seed: int | None = None) -> dict:
    """Random inputs of ``record_tokens`` (one decode step's bookkeeping): some rows finished, some sampling an
    EOS id, NaN log-probs on finished rows (they must record 0), the output buffers poisoned."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ())))
    finished = torch.rand(rows, generator=gen) < 0.3
    tok = torch.randint(0, 12, (rows,), generator=gen)        # ids 5 and 9 (EOS) come up often
    lp = -torch.rand(rows, generator=gen) * 5
    lp[finished] = float("nan")
    return dict(tok=tok, lp=lp, finished=finished, offset=torch.randint(0, cols, (rows,), generator=gen),
                token=torch.full((rows,), -7), out_tokens=torch.full((rows, cols), -7),
                out_logprobs=torch.full((rows, cols), float("nan")), out_mask=torch.full((rows, cols), -7),
                eos=torch.tensor(eos), lengths=torch.randint(0, 100, (rows,), generator=gen))


def cut_norm_links(model: torch.nn.Module) -> None:
    """Every injected decoder layer's link to the norm after it removed (``LayerSpec.next_norm``): each norm
    computes its own call again, the reference the decode with norms computed ahead is compared with."""
    from segki_lightning.inject.forwards import SPEC

    for layer in model.model.layers:
        if SPEC in layer.__dict__:
            layer.__dict__[SPEC].next_norm = layer.__dict__[SPEC].next_owner = None
