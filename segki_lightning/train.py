"""``segki-train``: the Hydra entry point for the GRPO / PPO recipes."""
from __future__ import annotations

import sys


def main() -> int:
    """Run a recipe (arrives with the Lightning integration)."""
    sys.stderr.write("segki-train: the GRPO/PPO recipes are not implemented yet in this version; "
                     "use segki_lightning.apply_segment_ki directly.\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
