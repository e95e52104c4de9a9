"""Pure-PyTorch reference of every fused op: the test oracle, the CPU / fp32 / ineligible-input path, and
the porting spec for the CUDA kernels in ``segki_lightning/csrc``. Native ops share these names and
signatures. All references are differentiable compositions of torch ops, so they also serve training."""
from .attention import attention_prologue, decode_attention, decode_attention_step, rope, valid_mask, write_token
from .gdn import (gdn_chunked, gdn_conv_step, gdn_decode_step, gdn_gates, gdn_in_proj_conv, gdn_recurrence,
                  gdn_recurrent_step, l2norm)
from .linear import gated_mlp_front, gdn_in_proj, linear, qkv_proj, silu_mul, skinny_linear, skinny_linear_sums
from .lora import lora_add
from .norm import add_rms_norm, add_rms_norm_sums, gated_rms_norm, rms_norm, sum_segments
from .sampling import process_logits, record_tokens, sample_tokens, uniform_noise
from .timeline import timeline_stamps

__all__ = [
    "add_rms_norm", "add_rms_norm_sums", "attention_prologue", "decode_attention", "decode_attention_step",
    "gated_mlp_front", "gated_rms_norm", "gdn_chunked", "gdn_conv_step", "gdn_decode_step", "gdn_gates", "gdn_in_proj",
    "gdn_in_proj_conv", "gdn_recurrence", "gdn_recurrent_step", "l2norm", "linear", "lora_add", "process_logits",
    "qkv_proj", "record_tokens", "rms_norm", "rope", "sample_tokens", "silu_mul", "skinny_linear",
    "skinny_linear_sums", "sum_segments", "timeline_stamps", "uniform_noise", "valid_mask", "write_token",
]
