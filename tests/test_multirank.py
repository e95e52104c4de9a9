"""Exactness across ranks: two gloo processes, each with its own rows, give (after DDP's gradient average) the
gradient of one process over all rows -- dapo divides by the global token count, ``scale_rewards=batch`` by the
std of every rank's rewards (TRL's semantics over the global batch)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from segki_lightning.rl import GRPOConfig, Totals, group_advantages, grpo_loss
from segki_lightning.rl.dist import gather_rows

ROWS, T, G = 8, 6, 4


def data(seed: int):
    """Rows of two ranks (rank r holds rows 4r..4r+3, one prompt group each); rank 1 has far fewer tokens."""
    gen = torch.Generator().manual_seed(seed)
    base = -torch.rand(ROWS, T, generator=gen) * 2
    old = base + 0.3 * torch.randn(ROWS, T, generator=gen)
    rewards = torch.rand(ROWS, generator=gen)
    mask = torch.ones(ROWS, T, dtype=torch.long)
    mask[4:, 2:] = 0
    return base, old, rewards, mask


def grad(rows: slice, seed: int, loss_type: str, batch_std) -> torch.Tensor:
    base, old, rewards, mask = data(seed)
    w = torch.zeros(T, requires_grad=True)           # a parameter every row's log-probs depend on
    logp = base[rows] + w
    cfg = GRPOConfig(loss_type=loss_type, scale_rewards="batch", num_generations=G, max_completion_length=T)
    adv = group_advantages(rewards[rows], G, "batch", batch_std(rewards[rows]))
    loss, _ = grpo_loss(logp, old[rows], None, adv, mask[rows], cfg, Totals.of(mask[rows]))
    loss.backward()
    return w.grad


def _rank(rank: int, folder: str, seed: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    for loss_type in ("dapo", "bnpo"):
        g = grad(slice(4 * rank, 4 * rank + 4), seed, loss_type, lambda r: gather_rows(r).std())
        dist.all_reduce(g)
        g /= 2                                        # what DDP does with the ranks' gradients
        if rank == 0:
            torch.save(g, f"{folder}/{loss_type}.pt")
    dist.destroy_process_group()


def test_dapo_and_batch_scaling_are_exact_across_two_ranks(tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    want = grad(slice(0, ROWS), seed, "dapo", lambda r: r.std())
    mp.spawn(_rank, args=(str(tmp_path), seed), nprocs=2, join=True)   # one pair of processes for both losses
    got, local = torch.load(tmp_path / "dapo.pt"), torch.load(tmp_path / "bnpo.pt")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    # per-rank normalisation (bnpo: TRL's local token mean) is NOT the global mean on these uneven ranks
    assert (local - want).norm() > 1e-3 * want.norm()
