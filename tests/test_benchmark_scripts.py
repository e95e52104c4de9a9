"""The benchmark scripts' own arithmetic, on CPU: what they report must be what the inputs say."""
from __future__ import annotations

import csv
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def write_metrics(path: Path, columns: dict[str, list[float]]) -> Path:
    """A ``metrics.csv`` as Lightning's CSVLogger writes it: one row per step, plus a row of other keys."""
    path.parent.mkdir(parents=True)
    names = ["step", "time/step_s", *columns]
    steps = len(next(iter(columns.values())))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, names)
        w.writeheader()
        w.writerow({"step": 0})   # a row without time/step_s: not a step
        for i in range(steps):
            w.writerow({"step": i, "time/step_s": 1.0, **{k: v[i] for k, v in columns.items()}})
    return path


def test_compare_curves_reports_differences_and_the_repeat_yardstick(tmp_path):
    ref, other, repeat = (torch.randn(6).tolist() for _ in range(3))
    runs = [write_metrics(tmp_path / name / "logs" / "metrics.csv", {"train/loss": values})
            for name, values in (("ref", ref), ("other", other), ("repeat", repeat))]
    out = tmp_path / "curves"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_curves.py"), "--out", str(out), "--runs",
                    str(runs[0].parent.parent), str(runs[1]), "--repeat", str(runs[2]), "--metrics", "train/loss"],
                   check=True, capture_output=True, cwd=ROOT / "benchmarks")
    (got,) = json.loads((out / "curves_summary.json").read_text())
    diffs = [abs(a - b) for a, b in zip(ref, other)]
    assert got["max_abs_diff"] == max(diffs) and got["at_step"] == diffs.index(max(diffs)) + 1
    assert math.isclose(got["rms_diff"], math.sqrt(sum(d * d for d in diffs) / 6))
    assert got["repeat_max_abs_diff"] == max(abs(a - b) for a, b in zip(ref, repeat))
    assert got["ref_range"] == max(ref) - min(ref)
    rows = json.loads((out / "curves.json").read_text())
    assert [r["loss_other"] for r in rows] == other and [r["loss_repeat"] for r in rows] == repeat


def load_script(name: str):
    import importlib.util

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)   # (its dataclasses look it up there)
    spec.loader.exec_module(module)
    return module


def test_grpo_summary_takes_the_median_rollout_so_one_slow_step_does_not_move_the_share(tmp_path):
    """One training step stalled for seconds (a collection, a flush) must not change the reported step time or
    rollout share; with ``num_iterations=2`` a rollout's time is spread over the two steps that use it."""
    grpo = load_script("grpo_gpu")
    rollouts = [0.6 + 0.01 * torch.rand(()).item() for _ in range(8)]
    steps = [r + 0.5 for r in rollouts]
    steps[5] += 3.0                                   # the stall
    path = tmp_path / "run" / "logs" / "metrics.csv"
    path.parent.mkdir(parents=True)
    keys = ["time/step_s", "time/rollout_s", "time/train_tokens_per_s", "rollout/tokens_per_s",
            "train/completion_length", "rollout/logprob_diff_mean", "rollout/kl_sampler_trainer"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, ["step", *keys])
        w.writeheader()
        for i, (s, r) in enumerate(zip(steps, rollouts)):
            w.writerow({"step": i, **dict.fromkeys(keys, 1.0), "time/step_s": s, "time/rollout_s": r})
    got = grpo.summarize(tmp_path / "run", warm=0, params=1, devices=1)
    assert all(math.isnan(got[f"{part}_s"]) for part in ("setup", "prefill", "decode", "collect"))  # older logs
    split = tmp_path / "split" / "logs" / "metrics.csv"                          # num_iterations=2: every second
    split.parent.mkdir(parents=True)                                             # step rolls out and logs the split
    names = ("setup", "prefill", "decode", "collect")
    parts = [[0.01 * torch.rand(()).item() + (0.5 if n == "decode" else 0.0) for n in names] for _ in range(4)]
    with open(split, "w", newline="") as f:
        w = csv.DictWriter(f, ["step", *keys, *(f"time/rollout_{n}_s" for n in names)])
        w.writeheader()
        for i in range(8):
            values = parts[i // 2] if i % 2 == 0 else [""] * len(names)
            w.writerow({"step": i, **dict.fromkeys(keys, 1.0), "time/rollout_s": 0.6 if i % 2 == 0 else 0.0,
                        **{f"time/rollout_{n}_s": v for n, v in zip(names, values)}})
    halves = grpo.summarize(tmp_path / "split", warm=0, params=1, devices=1)
    for j, n in enumerate(names):
        assert halves[f"{n}_s"] == round(statistics.median(p[j] for p in parts), 4), n
    assert got["step_s"] == round(statistics.median(steps), 3) and got["rollout_s"] == round(statistics.median(rollouts), 3)
    assert got["slowest_step_s"] == round(max(steps), 3)
    assert got["step_s_by_step"] == [round(x, 3) for x in steps] and got["gc_s_by_step"] == [None] * 8
    assert math.isclose(got["rollout_share"], statistics.median(rollouts) / statistics.median(steps), abs_tol=1e-3)
    reused = [(s, r if i % 2 == 0 else 0.0) for i, (s, r) in enumerate(zip(steps, rollouts))]   # num_iterations=2
    pairs = grpo.per_rollout([{"time/step_s": s, "time/rollout_s": r} for s, r in reused])
    assert pairs == [((reused[i][0] + reused[i + 1][0]) / 2, reused[i][1] / 2) for i in range(0, 8, 2)]


def test_grpo_logs_lose_lightnings_install_tips_and_nothing_else(tmp_path):
    grpo = load_script("grpo_gpu")
    log = tmp_path / "run.log"
    kept = ["cmd --x\n", "Seed set to 0\n", "  tip of the day: unchanged\n", "[step] 0.99 s\n"]
    log.write_text(kept[0] + "\N{ELECTRIC LIGHT BULB} Tip: try installing a logger\n" + "".join(kept[1:]))
    grpo.drop_tips(log)
    grpo.drop_tips(tmp_path / "absent.log")
    assert log.read_text() == "".join(kept)


def test_sass_order_reads_the_issue_order_and_registers_of_each_gemv_kernel():
    sass_order = load_script("sass_order")
    name = "_ZN5segki12_GLOBAL__N_115gemv_mma_kernelI13__nv_bfloat16Li2ELNS0_8EpilogueE0ELb1EEEvNS0_8GemvArgsIT_EEi"
    small = "_ZN5segki12_GLOBAL__N_117gemv_small_kernelI13__nv_bfloat16Li1ELNS0_8EpilogueE1EEEvNS0_8GemvArgsIT_EE"
    sass = "\n".join([
        f"\t\tFunction : {name}",
        "        /*0100*/  @!P2 LDG.E.NA.128.CONSTANT R8, desc[UR6][R18.64] ;",
        "        /*0110*/  LDG.E.128.CONSTANT R36, desc[UR6][R48.64] ;",
        "        /*0120*/  HMMA.16816.F32.BF16 R52, R24, R36, R52 ;",
        "        /*0130*/  @P0 BRA 0x3ad0 ;",
        f"\t\tFunction : {small}",
        "        /*0100*/  LDG.E.NA.128.CONSTANT R8, desc[UR6][R18.64] ;",
        "        /*0110*/  FFMA R1, R2, R3, R1 ;",
        "        /*0120*/  SHFL.BFLY PT, R4, R1, 0x10, 0x1f ;",
        "\t\tFunction : _ZN5segki15rms_norm_kernelEv",
        "        /*0100*/  LDG.E.128.CONSTANT R8, desc[UR6][R18.64] ;",
    ])
    assert sass_order.kernels(sass) == {"mma plain NB=2 pipe=1": "WxM|", "small gated rows<=1": "Wfs"}
    res = f" Function {name}:\n  REG:128 STACK:0 SHARED:1024\n Function {small}:\n  REG:56 STACK:0\n"
    assert sass_order.registers(res) == {"mma plain NB=2 pipe=1": 128, "small gated rows<=1": 56}


def sample_stacks(tmp_path, source: str, *args: str) -> Callable[..., str]:
    """Run module ``source`` under the stack sampler (with ``args``); returns the summary of its samples for the
    given summary arguments."""
    (tmp_path / "steps_mod.py").write_text(source)
    out = tmp_path / "stacks.jsonl"
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    sampler = [sys.executable, str(ROOT / "benchmarks" / "stack_sampler.py")]
    subprocess.run([*sampler, "--out", str(out), "-m", "steps_mod", *args], check=True, env=env)
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) > 30 and all(s["stack"] for s in samples)
    return lambda *summary: subprocess.run([*sampler, "--summary", str(out), *summary], check=True,
                                           capture_output=True, text=True, env=env).stdout


def test_stack_sampler_finds_the_function_that_holds_the_slow_step(tmp_path):
    """A module whose third "step" sleeps in its own function: the sampler's summary names it for the longest
    segment, and not for the median one."""
    summary = sample_stacks(
        tmp_path,
        "import sys, time\n"
        "def rollout_and_score():\n    time.sleep(0.1)\n"
        "def slow_first_use():\n    time.sleep(0.6)\n"
        "def train(i):\n    time.sleep(0.1)\n    if i == 2:\n        slow_first_use()\n"
        "assert sys.argv[1:] == ['--steps', '4']\n"
        "for i in range(4):\n    rollout_and_score()\n    train(i)\n", "--steps", "4")("--show", "2")
    assert summary.count("segment ") >= 5
    assert "longest segment 3 " in summary
    top = summary.split("samples outside rollout_and_score\n")[1].splitlines()[0].split()
    assert int(top[0]) >= 20 and top[1] == "0" and "slow_first_use" in top[2]


def test_stack_sampler_splits_each_step_by_part(tmp_path):
    """Steps of a rollout, a loss (0.1 s, in a helper) and a backward (0.2 s): each segment's time outside the
    rollout splits by the first named function its stack holds, and the frames inside the loss after the warm
    step name the helper."""
    text = sample_stacks(
        tmp_path,
        "import time\n"
        "def rollout_and_score():\n    time.sleep(0.05)\n"
        "def helper():\n    time.sleep(0.1)\n"
        "def step_loss():\n    helper()\n"
        "def backward():\n    time.sleep(0.2)\n"
        "for i in range(3):\n    rollout_and_score()\n    step_loss()\n    backward()\n",
    )("--parts", "backward,step_loss", "--inside", "step_loss", "--warm", "1")
    rows = [line for line in text.splitlines() if line.startswith("segment ") and "backward " in line]
    assert len(rows) == 4                                              # the start-up, then three steps
    for row in rows[1:]:
        words = row.split(": ")[1].replace(",", "").split()                 # name seconds name seconds ...
        got = dict(zip(words[::2], map(float, words[1::2])))
        assert 0.15 <= got["backward"] <= 0.25 and 0.06 <= got["step_loss"] <= 0.14, row
    inside = text.split("innermost frames inside step_loss")[1].splitlines()[1].split()
    assert "steps_mod.py:helper" == inside[1] and int(inside[0]) >= 5


def test_stack_sampler_sees_the_thread_a_backward_runs_on(tmp_path):
    """A step whose main thread waits in ``backward`` while a worker thread runs Python (as the autograd engine's
    thread runs a checkpointed forward's recompute): recorded with ``--all-threads``, ``--others`` names the
    worker's function, and the main thread's samples never hold it."""
    text = sample_stacks(
        tmp_path,
        "import threading, time\n"
        "def rollout_and_score():\n    time.sleep(0.05)\n"
        "def recompute(until):\n    while time.perf_counter() < until:\n        pass\n"
        "def backward():\n"
        "    t = threading.Thread(target=recompute, args=(time.perf_counter() + 0.3,))\n    t.start()\n    t.join()\n"
        "for i in range(4):\n    rollout_and_score()\n    backward()\n",
        "--all-threads",
    )("--others", "--warm", "1", "--show", "1")
    rows = text.split("other threads in Python code")[1].splitlines()
    assert "steps_mod.py:recompute" in rows[1] and int(rows[1].split()[0]) >= 5, rows
    main = [json.loads(line)["stack"] for line in (tmp_path / "stacks.jsonl").read_text().splitlines()]
    assert not any(":recompute:" in frame for stack in main for frame in stack)


def test_step_timeline_reads_phases_gaps_and_dry_time_per_sm():
    """Two product launches of two blocks on SMs 3 and 5 with a recurrence block between them on SM 3: each
    phase's mean (the SM clock at 2 cycles per ns, each SM's counter at its own offset), the sums inside first ->
    last, when the last unit landed (after the wait, and before it was multiplied; none where not stamped), the
    span, the end spread, and against the previous product block on the same SM (the recurrence's is not one) the
    gap to this block's start and the dry time to its first unit."""
    tl = load_script("step_timeline")
    ns, per_ns = 1000, 2   # times below in us; stamps in ns and cycles

    def rec(launch, block, sm, times, unit_wait=0, tile_ends=0, units=1, landed=None):
        def at(t):
            return sm * 10**9 + t * ns * per_ns

        return [launch << 32 | block, sm << 32 | 2, times[0] * ns, times[-1] * ns, *map(at, times),
                unit_wait * ns * per_ns, tile_ends * ns * per_ns, units, 0 if landed is None else at(landed)]

    # phases: start, waited, loaded, reduced, staged, first, last, end
    words = [rec(7, 0, 3, [0, 1, 1.5, 2, 2, 4, 8, 9], unit_wait=1, units=3, landed=3),
             rec(7, 1, 5, [1, 1, 2, 2.5, 3, 4, 9, 11], unit_wait=2, tile_ends=1, units=5, landed=0.5),
             rec(9, 0, 3, [9, 9.5, 9.5, 9.5, 9.5, 9.5, 9.5, 9.75]),      # the recurrence, on SM 3 at 9-9.75
             rec(8, 0, 3, [10, 10, 11, 11, 12, 13, 14, 15]), rec(8, 1, 5, [12, 12, 12.5, 12.5, 13, 15, 16, 16]),
             rec(99, 0, 3, [0] * 8)]          # a launch the table does not know: left out
    table = [dict(launch=7, kind=0, rows=1, k=2048, n=1024, gated=0, grid=2, parts=2, tiles=64),
             dict(launch=8, kind=0, rows=1, k=1024, n=3584, gated=1, grid=2, parts=1, tiles=448),
             dict(launch=9, kind=1, rows=1, k=128, n=2048, gated=0, grid=1, parts=4, tiles=16)]
    blocks = tl.blocks_of(words)
    launches, per_shape = tl.summarize(blocks, table)
    first, recurrence, second = launches
    assert recurrence["shape"] == "recurrence 1x16 heads" and recurrence["start_waited"] == 0.5
    assert recurrence["gap_us"] is None and recurrence["dry_us"] is None
    assert first["shape"] == "1x2048->1024" and second["shape"] == "1x1024->3584 gated"
    assert first["at_us"] == 0 and second["at_us"] == 10
    assert first["span_us"] == 11 and first["end_spread_us"] == 1          # ends 9 and 11, median 10
    assert first["start_waited"] == 0.5 and first["waited_loaded"] == 0.75 and first["loaded_reduced"] == 0.5
    assert first["reduced_staged"] == 0.25 and first["staged_first"] == 1.5
    assert first["first_last"] == 4.5 and first["last_end"] == 1.5
    assert first["unit_wait_us"] == 1.5 and first["tile_ends_us"] == 0.5 and first["units"] == 4
    assert first["landed_us"] == 0.75 and first["landed_last_us"] == 6.75   # 2 and -0.5 after the wait; 5 and 8.5
    assert second["landed_us"] is None and second["landed_last_us"] is None
    assert first["gap_us"] is None and first["dry_us"] is None              # nothing before on those SMs
    assert second["gap_us"] == 1.0 and second["dry_us"] == 4.0              # SM 3: 9 -> 10 (13); SM 5: 11 -> 12 (15)
    assert [r["shape"] for r in per_shape] == ["1x2048->1024", "recurrence 1x16 heads", "1x1024->3584 gated"]
    assert per_shape[2]["gap_us"] == 1.0 and "at_us" not in per_shape[2] and "gap_us" not in per_shape[1]
    rows = tl.block_rows(blocks, table)                                     # every known block, from t0
    assert len(rows) == 5 and rows[1]["shape"] == "1x2048->1024" and rows[1]["waited"] == 1.0
    assert rows[1]["unit_wait_us"] == 2.0 and rows[1]["units"] == 5 and rows[2]["gap"] is None
    assert rows[0]["landed"] == 3.0 and rows[1]["landed"] == 0.5 and rows[2]["landed"] is None
    assert rows[3]["gap"] == 1.0 and rows[3]["dry"] == 4.0
    with pytest.raises(ValueError, match="no time"):
        tl.blocks_of([rec(7, 0, 3, [0] * 8)])


def test_step_timeline_names_every_kind_the_kernels_stamp():
    """Every kind of csrc/timeline.cuh's StampKind has its own name in the tables (none falls to the product's
    ``rows x K -> N``), read with the numbers its launch table row holds."""
    import re

    tl = load_script("step_timeline")
    enum = re.search(r"enum StampKind[^{]*\{([^}]*)\}", (ROOT / "segki_lightning/csrc/timeline.cuh").read_text())
    kinds = {name: int(v) for name, v in re.findall(r"(k\w+) = (\d+)", enum.group(1))}
    assert sorted(kinds.values()) == list(range(len(kinds))) and len(kinds) == 7

    def named(kind, **shape):
        return tl.label(dict(dict(launch=0, rows=16, k=0, n=0, gated=0, grid=1, parts=0, tiles=0), kind=kind, **shape))

    assert named(kinds["kSkinnyProduct"], k=2560, n=12352) == "16x2560->12352"
    assert named(kinds["kSkinnyProduct"], k=2560, n=9216, gated=3) == "16x2560->9216 gated x in registers"
    assert named(kinds["kSkinnyProduct"], k=2560, n=12352, gated=2) == "16x2560->12352 x in registers"
    assert named(kinds["kNorm"], k=2560, gated=1, parts=4) == "add+norm 16x2560 of 4 sums"
    assert named(kinds["kNorm"], k=2560) == "norm 16x2560"
    assert named(kinds["kSegmentSums"], n=2560, parts=9) == "segment sums 16x2560 of 9"
    assert named(kinds["kGdnConv"], k=4, n=8192) == "conv 16x8192 channels"
    assert named(kinds["kGdnPipe"], k=128, n=4096, parts=512, tiles=32) == "streamed recurrence 16x32 heads"
    conv_inside = named(kinds["kGdnPipe"], k=128, n=4096, gated=1, parts=512, tiles=32)
    assert conv_inside == "conv+streamed recurrence 16x32 heads"
    others = {named(v, k=128, n=2048, parts=4, tiles=16) for v in kinds.values() if v}
    assert len(others) == len(kinds) - 1 and not any("->" in name for name in others)
    step = dict(launch=10, kind=2, rows=1, k=256, n=8, gated=1, grid=32, parts=16, tiles=2)   # the attention step
    assert tl.label(step) == "attention step 1x2 KV heads x 16 splits"
