"""The process a run of Megatron-Core models needs, and a prefill's inputs: `init_parallel`
(the process group, Megatron's parallel state for TP x EP, seeds) and `token_inputs`
(random token ids per attention data-parallel rank). The prefill launcher and
tools/bench_layer.py start this way.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch
import torch.distributed as dist


def _preload(target: str) -> None:
    """Import `target` (a .py file or a module name) and call its install() if it has one."""
    if target.endswith(".py") or os.sep in target:
        spec = importlib.util.spec_from_file_location("_megatron_overlap_preload", target)
        if spec is None:
            raise ValueError(f"--preload: cannot load {target!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    if hasattr(module, "install"):
        module.install()


def init_parallel(tp: int, ep: int, seed: int = 0, preload: str | None = None) -> torch.device:
    """This process's group (NCCL, gloo without CUDA), Megatron's parallel state for TP x EP
    (the rest data-parallel) and seeds; returns this rank's device. What a run of
    `build_model` needs first; a process group already made stays.

    preload: a .py file or module whose install() redirects Megatron-Core's CUDA-only call
    sites, loaded first; required without CUDA (`tests/mcore_shims.py`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if preload:
        _preload(preload)
    cuda = torch.cuda.is_available()
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # multicast stays off
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        local = os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(int(local))
    elif preload is None:
        raise ValueError("Megatron-Core MoE calls CUDA-only functions; on CPU pass "
                         "--preload tests/mcore_shims.py (and TRITON_INTERPRET=1 for the "
                         "interpret backend)")
    world = dist.get_world_size()
    if world % (tp * ep):
        raise ValueError(f"world size {world} does not fit TP={tp} x EP={ep}")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)  # CPU initialization draws master weights identically everywhere
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def token_inputs(batch: int, seq: int, vocab: int, device: torch.device, seed: int = 0):
    """Random token ids [B/DP, S] of this attention-DP rank (the same on its TP peers) and
    their positions: a prefill's input, B = `batch` sequences split over the data-parallel
    ranks (world / TP; after `init_parallel`)."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if batch % dp:
        raise ValueError(f"batch {batch} must be divisible by the data-parallel size {dp} "
                         f"(world / TP)")
    gen = torch.Generator().manual_seed(seed * 1000 + dp_rank)
    tokens = torch.randint(0, vocab, (batch // dp, seq), generator=gen)
    positions = torch.arange(seq).expand_as(tokens)
    return tokens.to(device), positions.contiguous().to(device)
