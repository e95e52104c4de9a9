"""The runnable Hydra recipes (``segki-train --config-name <name>``); shipped as ``segki_lightning.recipes``."""
