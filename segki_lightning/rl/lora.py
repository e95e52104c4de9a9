"""LoRA RL through peft: the base weights frozen, low-rank adapters trained (fp32 where the base is half
precision, peft's default), only the adapters in the optimizer; the KL reference is the base itself (adapters
switched off, no copy, as TRL does with peft); export writes peft's adapter folder or, on request, the merged model.

The RL modules compute on the transformers model inside the ``PeftModel`` (its projections are peft's LoRA layers
in place), so log-probs, rollouts and FLOP counts see the architecture they know; the ``PeftModel`` stays at hand
for switching the adapters off and for saving them."""
from __future__ import annotations

import sys
from typing import Any

from torch import nn

# every projection of attention, Gated-DeltaNet and the MLP (peft's "all-linear" leaves the output head out)
ALL_LINEAR = "all-linear"


def is_peft(model: Any) -> bool:
    """A ``PeftModel``. Asked without importing peft (whose import pulls in bitsandbytes where that is installed,
    ~2 s): a model of peft's classes exists only once peft has been imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def apply_lora(model: nn.Module, r: int, lora_alpha: int, lora_dropout: float = 0.0,
               target_modules: str | list[str] = ALL_LINEAR) -> nn.Module:
    """``model`` wrapped by peft with LoRA adapters of rank ``r`` (scale ``lora_alpha / r``) on ``target_modules``;
    the base frozen. peft's names and meanings (``peft.LoraConfig``)."""
    from peft import LoraConfig, get_peft_model

    if r < 1 or lora_alpha <= 0 or not 0.0 <= lora_dropout < 1.0:
        raise ValueError(f"lora.r must be >= 1, lora.lora_alpha > 0 and lora.lora_dropout in [0, 1), got {r}, "
                         f"{lora_alpha}, {lora_dropout}")
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, task_type="CAUSAL_LM",
                     target_modules=target_modules if isinstance(target_modules, str) else list(target_modules))
    return get_peft_model(model, cfg)


def export_adapters(peft_model: nn.Module, tokenizer: Any, path: str, merged: bool = False) -> None:
    """peft's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) at ``path``, reloadable with
    ``PeftModel.from_pretrained(base, path)``; with ``merged``, the base with the adapters folded in as a plain
    transformers folder (``AutoModelForCausalLM.from_pretrained(path)``). The tokenizer beside either."""
    if merged:
        import copy

        copy.deepcopy(peft_model).merge_and_unload().save_pretrained(path)
    else:
        peft_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
