"""What a replicated (single-GPU or DDP) run keeps per GPU before activations, and a warning when that does
not fit: the weights, their gradients, fp32 master weights (half-precision models) and AdamW's two fp32
moments -- 16 bytes per parameter either way (bf16: 2 + 2 + 4 + 8; fp32: 4 + 4 + 8); with 8-bit AdamW
(``algo.optim=adamw_8bit``) the moments of tensors of ``MIN_8BIT_SIZE`` elements or more take 2 bytes, so 10.
Past that, FSDP (``trainer.strategy=fsdp``) divides all of it by the number of GPUs."""
from __future__ import annotations

from torch import nn

from ..lightning.fsdp import HALF
from .config import EIGHT_BIT

FITS = 0.9   # share of the GPU the fixed state may take before activations and the rollout cache are counted


MIN_8BIT_SIZE = 4096   # bitsandbytes' default: smaller tensors keep fp32 moments


def moment_bytes(numel: int, optim: str) -> int:
    """Bytes per element of AdamW's two moments of a tensor of ``numel`` elements under ``optim``."""
    return 2 if optim in EIGHT_BIT and numel >= MIN_8BIT_SIZE else 8


def replicated_state_bytes(model: nn.Module, master_weights: bool, optim: str = "adamw_torch_fused") -> int:
    """Bytes of ``model``'s weights, plus gradients, masters and AdamW moments (as ``optim`` keeps them) of the
    trainable ones (a frozen KL reference counts its weights only)."""
    total = 0
    for p in model.parameters():
        half = p.dtype in HALF
        extra = (p.element_size() + (4 if half and master_weights else 0) + moment_bytes(p.numel(), optim)
                 if p.requires_grad else 0)
        total += p.numel() * (p.element_size() + extra)
    return total


def replicated_state_warning(model: nn.Module, master_weights: bool, gpu_bytes: int,
                             optim: str = "adamw_torch_fused") -> str | None:
    """A warning that says what to change when the replicated state alone takes more than ``FITS`` of
    ``gpu_bytes``; None when it fits."""
    need = replicated_state_bytes(model, master_weights, optim)
    if need <= FITS * gpu_bytes:
        return None
    gib = 2**30
    eight_bit = optim in EIGHT_BIT
    return (f"segki: this policy's training state takes {need / gib:.1f} GiB per GPU when replicated (weights, "
            f"gradients, fp32 masters and AdamW moments: {10 if eight_bit else 16} bytes per parameter) of the "
            f"GPU's {gpu_bytes / gib:.1f} GiB, before activations and the rollout cache: expect out-of-memory. "
            + ("" if eight_bit else "algo.optim=adamw_8bit keeps AdamW's moments in 8 bits (bitsandbytes; "
               "10 bytes per parameter); ")
            + "trainer.strategy=fsdp shards it over the GPUs (with N GPUs each keeps 1/N).")


def out_of_memory_message(step: int, part: str, cfg, checkpointing: bool, sharded: bool, state_bytes: int,
                          allocated: int, total: int) -> str:
    """What a CUDA out-of-memory error in ``part`` of training step ``step`` leaves to change, with the GPU's
    numbers at the error: ``part`` is ``rollout`` (generation and its cache), ``old_logprob``/``reference``
    (the no-grad scoring passes) or ``update`` (forward, backward, optimizer step)."""
    gib = 2**30
    if part == "rollout":
        knobs = ["rollout.max_batch_size (rows decoded at once)", "algo.max_completion_length"]
    else:
        knobs = [f"algo.{key} (now {'null' if value is None else value})"   # Hydra's spelling of None
                 for key, value in (("micro_batch_size", cfg.micro_batch_size),
                                    ("micro_batch_tokens", cfg.micro_batch_tokens))]
        if not checkpointing:
            knobs.append("model.gradient_checkpointing=true")
    if not sharded and cfg.optim not in EIGHT_BIT:
        knobs.append(f"algo.optim=adamw_8bit (now {cfg.optim}: AdamW's moments in 8 bits, bitsandbytes)")
    knobs.append("more GPUs under trainer.strategy=fsdp" if sharded else
                 "trainer.strategy=fsdp (shards the training state over the GPUs)")
    return (f"segki: step {step}: CUDA out of memory in the {part} pass (this step's peak {allocated / gib:.1f} "
            f"GiB allocated of the GPU's {total / gib:.1f} GiB; the training state -- weights, gradients, fp32 "
            f"masters, AdamW moments -- takes {state_bytes / gib:.1f} GiB of it"
            f"{' before sharding' if sharded else ''}). "
            f"Change: {'; '.join(knobs)}.")
