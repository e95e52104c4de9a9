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
    assert loader.state_dict()["yielded"] == 0          # a finished epoch: the next one starts, nothing skipped
    assert len(list(loader)) == 12                      # no stale resume state


def test_a_resume_after_an_epochs_last_batch_starts_the_next_epoch():
    """The state taken after an epoch's last batch (as Lightning checkpoints it, having pulled exactly the
    loader's length) resumes with the next epoch's batches, not an empty replay of the finished one; and a
    consumer that stops at the length sees the same order as one that exhausts the iterator."""
    seed = int(torch.randint(0, 2**31, ()))
    want = batches(make(seed), 2)
    first = make(seed)
    seen = [b.tolist() for b in itertools.islice(iter(first), len(first))]   # Lightning's loop: stops at len
    resumed = make(seed)
    resumed.load_state_dict(first.state_dict())
    assert seen == want[:12] and [b.tolist() for b in resumed] == want[12:]


def test_repeated_batches_resume_mid_repeat():
    """``repeat=3``: each batch three times in a row (the optimizer steps of one rollout); a resume between two
    repeats continues with the remaining repeats of the same batch."""
    seed = int(torch.randint(0, 2**31, ()))

    def make3():
        return ResumableLoader(list(range(20)), batch_size=4, shuffle=True, drop_last=True, repeat=3,
                               generator=torch.Generator().manual_seed(seed))

    plain = batches(ResumableLoader(list(range(20)), batch_size=4, shuffle=True, drop_last=True,
                                    generator=torch.Generator().manual_seed(seed)), 1)
    want = [b for b in plain for _ in range(3)]
    assert batches(make3(), 1) == want and len(make3()) == 15
    first = make3()
    it = iter(first)
    seen = [b.tolist() for b in itertools.islice(it, 4)]   # stop inside the second batch's repeats
    resumed = make3()
    resumed.load_state_dict(first.state_dict())
    assert seen + batches(resumed, 1) == want
