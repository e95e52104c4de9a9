"""Fused ops: reference specs (``ops.reference``), the native extension, and per-op dispatch."""
from .dispatch import (
    add_rms_norm, attention_prologue, backend, decode_attention, decode_attention_step, folds_norm, fuses_gdn_conv,
    gated_mlp_front, gated_rms_norm, gdn_decode_step, gdn_gates, gdn_in_proj, gdn_in_proj_conv, gdn_recurrent_step,
    joint_weight, linear, linear_add_rms_norm, lora_add, process_logits, qkv_proj, record_tokens, rms_norm,
    sample_tokens, silu_mul, skinny_linear,
)

__all__ = [
    "add_rms_norm", "attention_prologue", "backend", "decode_attention", "decode_attention_step", "folds_norm",
    "fuses_gdn_conv", "gated_mlp_front", "gated_rms_norm", "gdn_decode_step", "gdn_gates", "gdn_in_proj",
    "gdn_in_proj_conv", "gdn_recurrent_step", "joint_weight", "linear", "linear_add_rms_norm", "lora_add",
    "process_logits", "qkv_proj", "record_tokens", "rms_norm", "sample_tokens", "silu_mul", "skinny_linear",
]
