"""Multi-turn rollout throughput against a single turn of the same total length (random bf16 weights, one GPU).

    python benchmarks/turns.py --out DIR [--model 0.8b] [--rows 64] [--turns 3] [--turn-tokens 128]
        [--observation-tokens 32] [--stagger 0]

Random weights never emit EOS on cue, so the benchmark's engine forces one at each turn's last completion index
(``turn_tokens`` model tokens a turn, then ``observation_tokens`` appended by ``respond``): every row ends its
turns at the same steps, as a batch of fixed-length turns would. The single-turn run generates
``turns * turn_tokens + (turns - 1) * observation_tokens`` tokens a row with no EOS. ``--stagger S``: row r ends
each turn but the last ``(r * 7 + j) % S`` tokens early (its next turn that much longer, the row's total the same),
so rows end their turns at different steps and each end costs the host an answer on its own. Throughput is the model's
tokens over the wall time of the whole call (the prompts' prefill, the decode steps that also feed the
observations, and ``respond``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import qwen35_config, write_results  # noqa: E402

from segki_lightning import RolloutEngine, SamplingConfig  # noqa: E402

PROMPT = 128
EOS = 7


class TurnEndEngine(RolloutEngine):
    """Samples EOS at each row's given completion indices (a [B, K] device tensor), inside the captured step too."""

    ends: torch.Tensor | None = None

    def _sample(self, logits, st, procs=(False, False)):
        tok, lp = super()._sample(logits, st, procs)
        if self.ends is not None:
            hit = (st.offset[:, None] == self.ends[:len(tok)]).any(-1)                        # [B]
            tok = torch.where(hit, torch.full_like(tok, EOS), tok)
        return tok, lp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="0.8b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--observation-tokens", type=int, default=32)
    ap.add_argument("--stagger", type=int, default=0, help="rows end their turns up to this many tokens apart")
    args = ap.parse_args()
    from transformers import Qwen3_5ForCausalLM

    cfg = qwen35_config(args.model, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    k, t, o = args.turns, args.turn_tokens, args.observation_tokens
    total = k * t + (k - 1) * o
    engine = TurnEndEngine(model, max_batch_size=args.rows, max_seq_len=PROMPT + total + 8, eos_token_id=[EOS])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (PROMPT,), generator=g).tolist() for _ in range(args.rows)]
    observation = [torch.randint(10, 1000, (o,), generator=g).tolist() for _ in range(args.rows)]
    sampling = SamplingConfig(max_new_tokens=total, temperature=1.0, seed=0)
    rows = []

    def timed(fn):
        fn()   # captures, compiles
        torch.cuda.synchronize()
        best = None
        for _ in range(3):
            t0 = time.perf_counter()
            batch = fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            best = (wall, batch) if best is None or wall < best[0] else best
        return best

    engine.ends = None
    wall, single = timed(lambda: engine.generate(prompts, sampling))
    model_tokens = int(single.completion_mask.sum())
    rows.append(dict(run="single turn", rows=args.rows, tokens_per_row=total, model_tokens=model_tokens,
                     wall_s=round(wall, 4), tok_s=round(model_tokens / wall, 1),
                     decode_s=round(single.stats.decode_s, 4), prefill_s=round(single.stats.prefill_s, 4)))
    # turn j ends at completion index (j + 1) * t + j * o - 1, less the row's stagger (its last turn never)
    early = lambda r, j: (r * 7 + j) % args.stagger if args.stagger and j < k - 1 else 0   # noqa: E731
    engine.ends = torch.tensor([[(j + 1) * t + j * o - 1 - early(r, j) for j in range(k)] for r in range(args.rows)],
                               device="cuda")
    respond = lambda rs, c: [observation[r] for r in rs]   # noqa: E731
    wall, multi = timed(lambda: engine.generate_turns(prompts, sampling, respond, max_turns=k))
    model_tokens = int((multi.completion_mask * multi.tool_mask).sum())
    s = multi.stats
    stagger = f", ends up to {args.stagger - 1} tokens apart" if args.stagger else ""
    rows.append(dict(run=f"{k} turns of {t} + {o}-token observations{stagger}", rows=args.rows, tokens_per_row=total,
                     model_tokens=model_tokens, wall_s=round(wall, 4), tok_s=round(model_tokens / wall, 1),
                     decode_s=round(s.decode_s, 4), prefill_s=round(s.prefill_s, 4), respond_s=round(s.respond_s, 4),
                     steps=s.steps, turns_min=int(multi.turns.min()), turns_max=int(multi.turns.max())))
    rows[-1]["vs_single"] = round(rows[-1]["tok_s"] / rows[0]["tok_s"], 3)
    header = (f"# Multi-turn rollout vs one turn of the same length (Qwen3.5-{args.model} shape, bf16, "
              f"{torch.cuda.get_device_name()})\n\nCommand: `python benchmarks/turns.py {' '.join(sys.argv[1:])}`")
    cols = ["run", "rows", "tokens_per_row", "model_tokens", "wall_s", "tok_s", "vs_single", "decode_s", "prefill_s",
            "respond_s", "steps", "turns_min", "turns_max"]
    write_results(args.out, "turns", rows, cols, header)
    print((args.out / "turns.md").read_text())


if __name__ == "__main__":
    main()
