"""ResumableLoader: a loader rebuilt from a checkpointed state continues with exactly the batches the
interrupted one would have produced, also in a later epoch."""
from __future__ import annotations

import itertools

import torch

from segki_lightning.rl.loader import ResumableLoader


def make(seed: int) -> ResumableLoader:
    return ResumableLoader(list(range(50)), batch_size=4, shuffle=True, drop_last=True,
                           generator=torch.Generator().manual_seed(seed))


def batches(loader, epochs: int) -> list[list[int]]:
    return [b.tolist() for _ in range(epochs) for b in loader]


def test_resume_mid_epoch_continues_the_same_order():
    seed = int(torch.randint(0, 2**31, ()))
    want = batches(make(seed), 3)                       # 12 batches per epoch
    for stop_epoch, stop_batch in ((0, 5), (1, 3), (2, 11)):
        first = make(seed)
        for _ in range(stop_epoch):
            list(first)
        it = iter(first)
        seen = [b.tolist() for b in itertools.islice(it, stop_batch)]
        state = first.state_dict()
        resumed = make(seed)                            # a fresh process: the generator starts from the seed
        resumed.load_state_dict(state)
        rest = [b.tolist() for b in resumed]
        done = stop_epoch * 12
        assert seen == want[done:done + stop_batch]
        assert rest == want[done + stop_batch:done + 12]
        assert [b.tolist() for b in resumed] == want[done + 12:done + 24] or stop_epoch == 2


def test_a_plain_new_epoch_is_not_skipped():
    loader = make(0)
    list(loader)
    assert loader.state_dict()["yielded"] == 12
    assert len(list(loader)) == 12                      # no stale resume state
