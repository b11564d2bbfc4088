"""The op's backward on a GPU (device machine): `pytest -m gpu tests/test_op_backward_gpu.py`.

torch._grouped_mm's CUTLASS kernels (bf16, sm90+) at widths they take as they are and at
widths ops/grouped.py pads, against float64 autograd on the same GPU.
"""

import pytest
import torch

from megatron_overlap.ops import OverlapConfig, gemm2_gather_rs
from megatron_overlap.ops.grouped import grouped_kernel, grouped_wgrad
from routing_cases import routed_problem
from test_op_backward import assert_matches, fp64_grads, fp64_partial, op_grads

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("backend,tokens,experts,hidden,ffn", [
    ("reference", 256, 6, 36, 20),  # N and K rows of 72 and 40 bytes: padded
    ("triton", 256, 6, 36, 16),  # N unaligned, K as the Triton backend needs
    ("triton", 4096, 60, 2048, 704),  # Qwen1.5-MoE at TP2: no copy
])
def test_gpu_gradients_for_x_weight_and_probs_match_fp64(backend, tokens, experts, hidden, ffn):
    p = routed_problem(0, 1, tokens=tokens, experts=experts, topk=4, ffn=ffn, hidden=hidden,
                       empty=(1, 4), device="cuda", seed=2)
    assert grouped_kernel(p["x"])
    grad_out = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    config = OverlapConfig(backend=backend, sync_errors=True)
    leaves = dict(x=p["x"], w=p["weight"], probs=p["probs"])
    counts = p["counts"].tolist()

    def ours(x, w, probs):
        return gemm2_gather_rs(x, w, counts, p["token_index"], tokens, 4, probs, config=config)

    def ref(x, w, probs):
        return fp64_partial(x, w, counts, p["token_index"], tokens, probs)

    _, got = op_grads(leaves, ours, grad_out)
    want = fp64_grads(leaves, ref, grad_out)
    for k in leaves:
        assert_matches(got[k].cpu(), want[k].cpu(), torch.bfloat16, k)
    assert int(got["w"][[1, 4]].count_nonzero()) == 0


@pytest.mark.parametrize("host_counts", [True, False])
def test_gpu_wgrad_of_experts_without_rows_is_exactly_zero(host_counts):
    counts = [300, 0, 0, 517, 0, 64]
    dy = torch.randn(sum(counts), 2048, device="cuda").to(torch.bfloat16)
    x = torch.randn(sum(counts), 704, device="cuda").to(torch.bfloat16)
    for _ in range(3):  # the allocator hands back memory that held other values
        torch.full((len(counts), 2048, 704), float("nan"), device="cuda")
        dw = grouped_wgrad(dy, x, torch.tensor(counts, device="cuda"),
                           counts if host_counts else None)
        assert int(dw[[1, 2, 4]].count_nonzero()) == 0
        assert torch.isfinite(dw).all()
