"""Per-token log-probabilities of completions under a causal LM, with the prompt left-padded."""
from __future__ import annotations

import torch
from torch import Tensor, nn


def completion_logprobs(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                        completion_mask: Tensor, temperature: float = 1.0,
                        value_head: nn.Module | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """``log_softmax(logits / T)`` at each completion token: ``[N, P]`` + ``[N, T]`` -> ``[N, T]`` fp32;
    with ``value_head``, also its values ``[N, T]`` on the last hidden state before each completion token.

    Positions count only real tokens (left padding does not shift them), so each row sees what it saw
    alone during the rollout."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)                       # [N, P+T]
    mask = torch.cat([prompt_mask, completion_mask], dim=1)                    # [N, P+T]
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                output_hidden_states=value_head is not None)
    p = prompt_ids.shape[1]
    logits = out.logits[:, p - 1:-1].float() / (temperature if temperature > 0 else 1.0)   # [N, T, V]
    logp = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]
    if value_head is None:
        return logp
    hidden = out.hidden_states[-1][:, p - 1:-1]                                 # [N, T, H]
    return logp, value_head(hidden.to(value_head.weight.dtype))[..., 0].float()
