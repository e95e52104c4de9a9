"""Early stops of RolloutEngine.generate (rollout/stops.py): rows a check names finish one stretch after it, the
tokens up to each row's stop are those of a run without the check (per-row draws), the loop ends sooner, and
StopStrings reads stop strings from text windows; a GRPO run's rollouts stop early and cut at the stop."""
from __future__ import annotations

import torch

from segki_lightning import RolloutEngine, SamplingConfig
from segki_lightning.rollout.engine import CHECK_EVERY
from segki_lightning.rollout.stops import StopStrings

from .tiny_models import VOCAB, build_model


class TokenStop:
    """Stops a row at any of ``stops`` (token ids)."""

    window = CHECK_EVERY + 1   # the first check comes after the prefill's token and CHECK_EVERY steps

    def __init__(self, stops):
        self.stops, self.calls = set(stops), 0

    def __call__(self, tails):
        self.calls += 1
        return [any(t in self.stops for t in tail) for tail in tails]

    def first(self, ids: list[int]) -> int:
        return next((i for i, t in enumerate(ids) if t in self.stops), len(ids))


def test_rows_stop_a_stretch_after_the_next_check_and_keep_their_tokens(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    engine = RolloutEngine(model, max_batch_size=16, max_seq_len=220, graph_capture=False, eos_token_id=[])
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = [torch.randint(2, VOCAB, (k,), generator=g).tolist() for k in (4, 9, 13)]
    cfg = SamplingConfig(max_new_tokens=200, temperature=1.0, n=3, seed=11)
    plain = engine.generate(prompts, cfg)
    check = TokenStop(plain.completion_ids[:, 20].tolist())   # every row meets a stop by its 21st token
    early = engine.generate(prompts, cfg, stop=check)
    assert check.calls >= 1 and early.stats.steps < plain.stats.steps
    for r in range(len(plain)):
        full = plain.completion_ids[r].tolist()
        got = early.completion_ids[r][early.completion_mask[r].bool()].tolist()
        k = check.first(full)
        assert got == full[:len(got)], r                       # the same draws up to where it stopped
        # the check after the stop runs while the next stretch decodes: finished at most two stretches on
        assert k < len(got) <= k + 2 * CHECK_EVERY + 1, (r, k, len(got))


def test_stop_strings_read_windows_of_text():
    from segki_lightning.rl.task import char_tokenizer

    tok = char_tokenizer()
    check = StopStrings(tok, ["+3", "=1"])
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]   # noqa: E731
    assert check([ids("12+3"), ids("1+2"), ids("x=1y"), ids("")]) == [True, False, True, False]
    assert check.window == CHECK_EVERY + 1 + 8


def test_a_grpo_rollout_with_stop_strings_stops_early_and_cuts_at_the_stop(tmp_path, monkeypatch):
    from segki_lightning.rl.grpo import GRPOModule
    from segki_lightning.train import run

    from .test_lightning import small

    seen = []
    real = GRPOModule.rollout

    def spy(self, prompts, sampling, stop=None):
        batch = real(self, prompts, sampling, stop)
        seen.append((stop, batch.stats.steps, sampling.max_new_tokens))
        return batch

    monkeypatch.setattr(GRPOModule, "rollout", spy)
    metrics = run(small(tmp_path, "algo.stop_strings=['1','2','3','4','5','6','7','8','9','0']",
                        "algo.max_completion_length=60", "trainer.max_steps=2"))
    assert all(isinstance(s, StopStrings) for s, _, _ in seen)
    assert all(steps < t - 1 for _, steps, t in seen)        # no rollout ran to the length
    assert metrics["train/completion_length"] < 60


def test_a_host_copy_is_the_state_when_it_was_taken():
    """rollout/host.py: what the stop check and the turns loop read later is a copy, not the live tensor (on CPU a
    tensor's .to('cpu') would be the tensor itself)."""
    from segki_lightning.rollout.host import HostCopy

    flags, tokens = torch.zeros(4, dtype=torch.bool), torch.arange(8).view(4, 2)
    copy = HostCopy(flags, tokens)
    flags[1], tokens[0, 0] = True, 99
    got_flags, got_tokens = copy.get()
    assert not got_flags.any() and got_tokens[0, 0] == 0
