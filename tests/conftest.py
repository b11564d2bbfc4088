"""CPU test set-up: the Triton interpreter on machines without CUDA; gpu marks skipped."""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: one intra-op thread each (and in the ranks they spawn,
    # which inherit the environment) instead of two threads each contending for both
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Must precede the first `import triton` (ours or Megatron's) in this process and in
    # the worker processes it spawns, which inherit the environment.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


#: the modules that take longest on the 2-core CI machine, longest first (pytest
#: --durations): `make test` runs two xdist workers, each taking whole modules in this
#: order (--dist loadfile, module fixtures once), so that no long one starts last
LONGEST_FIRST = ("test_mcore_layer.py", "test_tools_smoke.py", "test_op.py",
                 "test_hf_checkpoint.py", "test_report_data.py", "test_recovery.py",
                 "test_soak_tool.py", "test_mcore_spec.py", "test_reliability.py",
                 "test_kernels.py", "test_fp8_delayed.py", "test_mcore_fp8_training.py")


def _longest_first(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable)


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
