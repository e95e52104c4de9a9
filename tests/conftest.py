"""Test tiers: CPU always; ``gpu`` marked tests skip without CUDA; ``slow`` ones need --runslow."""
from __future__ import annotations

import pytest
import torch

from .tiny_models import build_model


@pytest.fixture
def tiny_qwen35(tmp_path):
    return build_model("qwen3_5", tmp_path)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow end-to-end tests")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow: opt in with --runslow")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
