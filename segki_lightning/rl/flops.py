"""Model FLOPs of a training pass, counted on real tokens (padding does not count), for ``time/train_tflops`` and
MFU: the matrix products a forward does once, and for forward + backward three times that, less the products a
frozen weight skips: its gradient (``2 x`` the weight per token), which a LoRA policy's frozen base never computes
(recomputation -- activation checkpointing, the chunked log-prob backward -- is not counted, as in PaLM's MFU).

Per forward: ``2 x`` the decoder's linear weights per token; ``2 x`` the output head per scored (completion)
token; causal softmax attention ``2 x Hq x D x L^2`` per row of length L and attention layer (QK^T and PV over the
causal half); Gated DeltaNet's chunked form (chunk BT = 64) ``6 Dk Dv + 2 BT (3 Dk + 2 Dv)`` per token and value
head (state products, the intra-chunk WY products and the output)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

GDN_CHUNK = 64
# dense bf16/fp16 tensor-core peaks (datasheets) of the GPUs MFU is reported for; others report TFLOP/s only
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12}


@dataclass(frozen=True)
class FlopShape:
    body: int              # decoder linear weights (every token)
    head: int              # output head weights (scored tokens)
    attention: int         # Hq x D summed over softmax-attention layers
    gdn: int               # per-token chunk-rule FLOPs summed over Gated-DeltaNet layers and value heads
    frozen_body: int = 0   # of ``body``, the weights that take no gradient (a LoRA policy's base)
    frozen_head: int = 0   # of ``head``, likewise

    @classmethod
    def of(cls, model: nn.Module) -> "FlopShape":
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head = model.get_output_embeddings()
        linears = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
        body = sum(w.numel() for w in linears)
        layers = getattr(cfg, "num_hidden_layers", 0)
        types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)
        n_attn = sum(t != "linear_attention" for t in types)
        heads = getattr(cfg, "num_attention_heads", 0)
        dim = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // max(heads, 1))
        dk, dv = getattr(cfg, "linear_key_head_dim", 0), getattr(cfg, "linear_value_head_dim", 0)
        per_head = 6 * dk * dv + 2 * GDN_CHUNK * (3 * dk + 2 * dv)
        gdn = (len(types) - n_attn) * getattr(cfg, "linear_num_value_heads", 0) * per_head
        head_w = head.weight if head is not None else None
        return cls(body, head_w.numel() if head_w is not None else 0, n_attn * heads * dim, gdn,
                   sum(w.numel() for w in linears if not w.requires_grad),
                   head_w.numel() if head_w is not None and not head_w.requires_grad else 0)

    def forward(self, lengths: list[int], scored: int) -> float:
        """Forward FLOPs of rows of ``lengths`` real tokens with ``scored`` tokens through the head."""
        tokens = sum(lengths)
        return (2 * self.body * tokens + 2 * self.head * scored + self.gdn * tokens
                + 2 * self.attention * sum(n * n for n in lengths))

    def training(self, lengths: list[int], scored: int) -> float:
        """Forward + backward FLOPs of the same rows: the backward twice the forward (the inputs' gradients and the
        weights'), without the weight gradients of frozen weights."""
        skipped = 2 * self.frozen_body * sum(lengths) + 2 * self.frozen_head * scored
        return 3.0 * self.forward(lengths, scored) - skipped


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of ``device`` when it is one of :data:`PEAK_BF16`'s GPUs, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name.split()), None)
