"""CPU test set-up: the Triton interpreter on machines without CUDA; gpu marks skipped."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first `import triton` (ours or Megatron's) in this process and in
    # the worker processes it spawns, which inherit the environment.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
