"""What an injection did, per segment kind: found, replaced, skipped (with reasons), backend per op."""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("gated_mlp", "gdn", "attention_qkv", "rms_norm", "attention", "decoder_layer")


@dataclass
class SegmentReport:
    """Outcome of :func:`apply_segment_ki`.

    Attributes:
        found: kind -> number of modules whose attribute structure matched.
        replaced: kind -> number whose forward now runs the fused ops.
        skipped: kind -> list of ``(module path, reason)`` for matches that were left alone.
        backends: kind -> ``{op: "native" | "reference"}`` for decode-time inputs of the model's dtype.
    """

    found: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    replaced: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    skipped: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: {k: [] for k in KINDS})
    backends: dict[str, dict[str, str]] = field(default_factory=dict)

    def skip(self, kind: str, name: str, reason: str) -> None:
        self.skipped[kind].append((name, reason))

    def to_dict(self) -> dict:
        """A plain dict (for loggers and JSON)."""
        return {"found": dict(self.found), "replaced": dict(self.replaced),
                "skipped": {k: [list(s) for s in v] for k, v in self.skipped.items()},
                "backends": {k: dict(v) for k, v in self.backends.items()}}

    def __str__(self) -> str:
        lines = [f"{'segment':<15}{'found':>6}{'replaced':>9}{'skipped':>8}  backend"]
        for kind in KINDS:
            ops = ", ".join(f"{op}={b}" for op, b in self.backends.get(kind, {}).items()) or "-"
            lines.append(f"{kind:<15}{self.found[kind]:>6}{self.replaced[kind]:>9}"
                         f"{len(self.skipped[kind]):>8}  {ops}")
        for kind in KINDS:
            lines += [f"  skipped {kind} {name}: {why}" for name, why in self.skipped[kind]]
        return "\n".join(lines)
