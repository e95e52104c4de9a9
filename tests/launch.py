"""``segki-train`` on several CPU processes started together, as ``torchrun`` starts them: each rank gets
``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_PORT`` and Lightning joins them instead of launching the others itself. The
ranks import in parallel, ~4 s less a run than Lightning's launcher on two cores, which starts rank 1 only after
rank 0 has imported and composed its config. As torchrun does, each rank runs one OpenMP thread unless
``OMP_NUM_THREADS`` says otherwise (Lightning's own launcher gives each ``cores // ranks``): two ranks of two threads
each on two cores spend ~20 % of a run's wall time waiting on each other's threads. Lightning's own launcher
(``trainer.devices=2`` alone, the README's way) stays covered by ``test_reliability.py``'s DDP signal test."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_ranks(folder: Path, *overrides: str, world: int = 2, timeout: float = 600) -> Path:
    """Runs ``python -m segki_lightning.train *overrides hydra.run.dir=folder`` on ``world`` ranks at once (the
    overrides set the strategy and ``trainer.devices=world``); asserts every rank exits 0 and returns ``folder``.
    Rank r > 0 logs to ``train_ddp_process_r.log`` and saves its Hydra config under ``.rank_r``, as under
    Lightning's launcher; each rank's output is in ``rank_r.out``. A rank that fails stops the others."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": "1", **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(world), "NODE_RANK": "0"}
    procs = []
    for rank in range(world):
        own = [] if rank == 0 else [f"hydra.job.name=train_ddp_process_{rank}", f"hydra.output_subdir=.rank_{rank}"]
        cmd = [sys.executable, "-m", "segki_lightning.train", *overrides, f"hydra.run.dir={folder}", *own]
        out = open(folder / f"rank_{rank}.out", "w")
        procs.append((subprocess.Popen(cmd, env={**env, "LOCAL_RANK": str(rank)}, cwd=folder, stdout=out,
                                       stderr=subprocess.STDOUT), out))
    deadline = time.monotonic() + timeout
    try:
        while (codes := [p.poll() for p, _ in procs]) != [0] * world:
            assert not set(codes) - {None, 0} and time.monotonic() < deadline, "a rank failed or the run timed out"
            time.sleep(0.05)
    except AssertionError as error:
        for p, _ in procs:
            p.kill()
        tails = "\n".join(f"-- rank {r}: {(folder / f'rank_{r}.out').read_text()[-3000:]}" for r in range(world))
        raise AssertionError(f"{error}\n{tails}") from None
    finally:
        for p, out in procs:
            p.wait()
            out.close()
    return folder
