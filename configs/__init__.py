"""The Hydra config groups the recipes compose; shipped as ``segki_lightning.configs``."""
