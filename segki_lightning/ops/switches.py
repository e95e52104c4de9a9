"""The kernel switches read from the environment (``SEGKI_*``): settings for measurements and debugging that
the native kernels read when they first run. Checked once, before the extension loads, so that a misspelt name
or value fails with what to change instead of leaving the default path to run unnoticed."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping

# name -> (accepted values, what the switch does); "<int >= -1>" accepts such a number, a pattern what it matches
KERNEL_SWITCHES = {
    "SEGKI_PDL": (("0", "1"), "0: launch each kernel after the previous one ends (no programmatic dependent "
                              "launch)"),
    "SEGKI_ATTN": (("online", "batched"), "batched: decode attention scoring several positions and heads at once; "
                                          "online: one position at a time (unset: batched from 64 rows x KV "
                                          "heads)"),
    "SEGKI_ATTN_STEP": (("split", "fused"), "split: a decode step's attention as three launches (prologue, "
                                            "attention, combine) at every size; fused: as one launch wherever it "
                                            "can run (unset: one launch up to 4 rows x KV heads and 2048 cache "
                                            "positions)"),
    "SEGKI_GEMV_PIPE": (("0", "1"), "0: the tensor-core GEMV with one stage of weight loads in flight"),
    "SEGKI_GEMV_BULK": (("0", "1"), "1/0: every / no 1-4 row GEMV through the copy engine (unset: by weight size)"),
    "SEGKI_GEMV_BULK_CHUNKS": (tuple("12345678"), "chunks of weight rows per block on the copy-engine path (1)"),
    "SEGKI_GEMV_PREFETCH": ("<int >= -1>", "bytes of each weight row warmed in L2 before the PDL wait (-1: all)"),
    "SEGKI_GEMV_MAX_ROWS": (re.compile(r"[1-9]\d*|\w+:[1-9]\d*(, *\w+:[1-9]\d*)*"),
                            "one native row limit for every decode GEMV, or op:rows pairs for those ops "
                            "(e.g. gated_mlp_front:32,linear:16)"),
    "SEGKI_FOLD_NORM": (("0", "1"), "0: each decoder-layer norm as its own kernel, not inside the skinny product "
                                    "(1-8 rows) or the copy-engine GEMV (1-2 rows) after it"),
    "SEGKI_SKINNY": (("0",), "0: the projections at 1-16 rows on the GEMVs and cuBLAS instead of the skinny product"),
    "SEGKI_SKINNY_XREG": (("0",), "0: the skinny product at 9-16 rows of K = 2560 keeps x in shared memory (default: "
                                  "in registers, the weight ring taking all of shared memory)"),
    "SEGKI_SKINNY_XSEG": (("0",), "0: the skinny product's deferred segments of K (9-16 rows past shared memory) "
                                  "in parts of 1024 columns with x in shared memory (default: 1536-2048 columns, x "
                                  "in registers)"),
    "SEGKI_SKINNY_FILL": (tuple("0123456"), "weight units a skinny product block keeps in flight while its ring "
                                            "first fills, at every row count; 0: the whole ring at once (unset: 2 "
                                            "at 1-8 rows, the whole ring at 9-16)"),
    "SEGKI_GDN_CONV": (("split",), "split: the GDN decode step's conv as its own kernel before the recurrence "
                                   "(default: inside the recurrence: the cluster kernel's at few rows, the "
                                   "streamed kernel's prologue at more)"),
    "SEGKI_TRAIN_FUSED": (("0", "1"), "0: training passes (update, old log-probs, reference) on CUDA run the fp32 "
                                      "reference compositions instead of flash-linear-attention's fused norms, "
                                      "SwiGLU and varlen conv"),
    "SEGKI_DQKWG_COMPILE": (("0", "1"), "0: segki's torch dq/dk/dw/dg of the Gated-DeltaNet backward (Hopper with "
                                        "Triton < 3.7.1) runs eagerly instead of compiled"),
    "SEGKI_LORA_OP": (("0", "1"), "0: a projection group's LoRA paths in decode as peft's composition (five or "
                                  "six launches a projection) instead of the native lora_add op (two a group)"),
    "SEGKI_JOINT": (("0", "1"), "0: past the native rows, one cuBLAS product per weight even where the weights are "
                                "packed"),
}
# other variables of the project: the build cache folder and the CI script's virtual environment
OTHER_VARIABLES = ("SEGKI_CACHE", "SEGKI_CI_VENV")


def _accepts(accepted: tuple[str, ...] | str | re.Pattern, value: str) -> bool:
    if isinstance(accepted, tuple):
        return value in accepted
    if isinstance(accepted, re.Pattern):
        return accepted.fullmatch(value) is not None
    low = int(accepted.split(">=")[1].rstrip(">"))
    try:
        return int(value) >= low
    except ValueError:
        return False


def check_switches(environ: Mapping[str, str] = os.environ) -> None:
    """Raises ValueError naming every ``SEGKI_*`` variable of ``environ`` that is unknown or has a value its
    switch does not accept, with the accepted names or values."""
    problems = []
    for name, value in sorted(environ.items()):
        if not name.startswith("SEGKI_") or name in OTHER_VARIABLES:
            continue
        if name not in KERNEL_SWITCHES:
            problems.append(f"{name} is not a segki switch (known: {', '.join(KERNEL_SWITCHES)}, "
                            f"{', '.join(OTHER_VARIABLES)}); unset it")
            continue
        accepted, meaning = KERNEL_SWITCHES[name]
        if not _accepts(accepted, value):
            shown = (" or ".join(accepted) if isinstance(accepted, tuple) else
                     accepted.pattern if isinstance(accepted, re.Pattern) else accepted)
            problems.append(f"{name}={value!r}: expected {shown} ({meaning}), or unset for the default")
    if problems:
        raise ValueError("segki kernel switches: " + "; ".join(problems))
