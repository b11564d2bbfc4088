"""The op's backward: grouped dgrad + wgrad at any width, checked against float64 autograd.

Every gradient (x, weight, probs, and the expert biases through the bias columns) is
compared element by element with a pure-torch float64 forward differentiated by autograd,
on random data with experts that get no rows, at widths whose rows are not 16-byte
multiples (torch._grouped_mm's rule, ops/grouped.py).
"""

import pytest
import torch

from dist_harness import run_ranks
from megatron_overlap.ops import (BIAS_COLUMNS, ExpertWeightStack, OverlapConfig,
                                  gemm2_gather_rs, with_bias_columns)
from megatron_overlap.ops import grouped as grouped_module
from megatron_overlap.ops.grouped import accepts, grouped_mm, grouped_wgrad
from routing_cases import routed_problem

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def assert_matches(actual: torch.Tensor, ref: torch.Tensor, dtype, what: str):
    """Every element within the dtype's tolerance of the float64 value (scaled by the
    tensor's largest magnitude: bf16 rounds each input to 8 bits)."""
    assert actual.shape == ref.shape, what
    assert torch.isfinite(actual).all(), what
    tol = TOL[dtype]
    scale = float(ref.abs().max()) or 1.0
    torch.testing.assert_close(actual.double(), ref, rtol=tol, atol=tol * scale, msg=what)


def fp64_partial(x, w, counts, token_index, tokens, probs=None):
    """This rank's [M, N] contribution in float64, differentiable: per-expert x W^T,
    scaled by probs, summed into each row's token."""
    ys, start = [], 0
    for e, n in enumerate(counts):
        ys.append(x[start:start + n] @ w[e].t())
        start += n
    y = torch.cat(ys)
    if probs is not None:
        y = y * probs[:, None]
    return torch.zeros(tokens, w.shape[1], dtype=y.dtype).index_add(0, token_index, y)


def fp64_grads(leaves: dict, forward, grad_full: torch.Tensor) -> dict:
    """Gradients of <grad_full, forward(**float64 leaves)> with respect to each leaf."""
    ref = {k: v.detach().double().requires_grad_(True) for k, v in leaves.items()}
    (forward(**ref) * grad_full.double()).sum().backward()
    return {k: v.grad for k, v in ref.items()}


def op_grads(leaves: dict, forward, grad_out: torch.Tensor) -> tuple:
    ours = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    out = forward(**ours)
    out.backward(grad_out)
    return out, {k: v.grad for k, v in ours.items()}


def _case(dtype, hidden, ffn, tokens=40, experts=6, topk=2):
    # experts 1 and 4 get no rows: their weight gradient must come back exactly zero
    p = routed_problem(0, 1, tokens=tokens, experts=experts, topk=topk, ffn=ffn,
                       hidden=hidden, dtype=dtype, empty=(1, 4), seed=11)
    assert p["counts"][1] == p["counts"][4] == 0
    g = torch.Generator().manual_seed(5)
    grad_out = torch.randn(tokens, hidden, generator=g).to(dtype)
    return p, grad_out


# (backend, dtype, hidden N, FC width K): N * itemsize or K * itemsize not a multiple
# of 16; the Triton backends need 16-byte rows of x (K), so they take only N unaligned
UNALIGNED = [("reference", torch.bfloat16, 36, 20), ("reference", torch.bfloat16, 40, 20),
             ("reference", torch.float32, 38, 18), ("reference", torch.bfloat16, 12, 8),
             ("interpret", torch.bfloat16, 36, 16), ("interpret", torch.float32, 38, 16)]


@pytest.mark.parametrize("path", ["grouped", "loop"])
@pytest.mark.parametrize("backend,dtype,hidden,ffn", UNALIGNED)
def test_unaligned_widths_give_fp64_output_and_gradients_for_x_weight_and_probs(
        monkeypatch, path, backend, dtype, hidden, ffn):
    if path == "loop":  # where torch has no grouped kernel (CUDA other than bf16 sm90+)
        monkeypatch.setattr(grouped_module, "grouped_kernel", lambda t: False)
    p, grad_out = _case(dtype, hidden, ffn)
    config = OverlapConfig(backend=backend)
    leaves = dict(x=p["x"], w=p["weight"], probs=p["probs"])

    def ours(x, w, probs):
        return gemm2_gather_rs(x, w, p["counts"], p["token_index"], 40, 2, probs, config=config)

    def ref(x, w, probs):
        return fp64_partial(x, w, p["counts"].tolist(), p["token_index"], 40, probs)

    out, got = op_grads(leaves, ours, grad_out)
    want = fp64_grads(leaves, ref, grad_out)
    assert_matches(out, ref(**{k: v.double() for k, v in leaves.items()}), dtype, "out")
    for k in leaves:
        assert_matches(got[k], want[k], dtype, k)
    assert torch.equal(got["w"][[1, 4]], torch.zeros_like(got["w"][[1, 4]]))


@pytest.mark.parametrize("dtype,ffn", [(torch.bfloat16, 20), (torch.bfloat16, 16),
                                       (torch.float32, 18)])
def test_expert_bias_gradients_flow_through_the_bias_columns(dtype, ffn):
    """Megatron's layout: E weights [N, K] and biases [N] stacked into [E, N, K + 8] and
    x with the bias scale (the row's prob) as a column: y = x W^T + scale * b."""
    p, grad_out = _case(dtype, 36, ffn)
    experts = p["weight"].shape[0]
    g = torch.Generator().manual_seed(9)
    leaves = dict(x=p["x"], scale=p["probs"].to(dtype),
                  b=torch.randn(experts, 36, generator=g).to(dtype),
                  **{f"w{e}": p["weight"][e] for e in range(experts)})
    stack = ExpertWeightStack()

    def ours(x, scale, b, **ws):
        weight = stack.operand([ws[f"w{e}"] for e in range(experts)], list(b.unbind(0)))
        assert weight.shape[2] == ffn + BIAS_COLUMNS
        return gemm2_gather_rs(with_bias_columns(x, scale), weight, p["counts"],
                               p["token_index"], 40, 2, config=OverlapConfig(backend="reference"))

    def ref(x, scale, b, **ws):
        w = torch.stack([ws[f"w{e}"] for e in range(experts)])
        bias_rows = torch.repeat_interleave(b, p["counts"], dim=0) * scale[:, None]
        y = fp64_partial(x, w, p["counts"].tolist(), torch.arange(x.shape[0]), x.shape[0])
        return torch.zeros(40, 36, dtype=y.dtype).index_add(0, p["token_index"], y + bias_rows)

    _, got = op_grads(leaves, ours, grad_out)
    want = fp64_grads(leaves, ref, grad_out)
    for k in leaves:
        assert_matches(got[k], want[k], dtype, k)
    assert torch.equal(got["b"][[1, 4]], torch.zeros_like(got["b"][[1, 4]]))


def _poisoned_grouped_mm(real):
    """torch._grouped_mm whose weight-gradient form leaves an empty group's output as the
    uninitialized memory it is (NaN here), as Blackwell's kernel does (pytorch#172439)."""
    def grouped(a, b, offs=None, **kw):
        out = real(a, b, offs=offs, **kw)
        if a.dim() == 2 and b.dim() == 2:
            starts = torch.cat([offs.new_zeros(1), offs[:-1]])
            out[offs == starts] = float("nan")
        return out
    return grouped


@pytest.mark.parametrize("host_counts", [True, False])
def test_experts_without_rows_get_exactly_zero_wgrad_even_from_a_poisoned_kernel(
        monkeypatch, host_counts):
    monkeypatch.setattr(torch, "_grouped_mm", _poisoned_grouped_mm(torch._grouped_mm))
    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 9, 0, 0, 3]
    dy = torch.randn(17, 36, generator=g).to(torch.bfloat16)
    x = torch.randn(17, 24, generator=g).to(torch.bfloat16)
    dw = grouped_wgrad(dy, x, torch.tensor(counts), counts if host_counts else None)
    assert torch.equal(dw[[1, 3, 4]], torch.zeros(3, 36, 24, dtype=torch.bfloat16))
    ref = torch.stack([dy[s:s + n].double().t() @ x[s:s + n].double()
                       for s, n in zip([0, 5, 5, 14, 14, 14], counts)])
    assert_matches(dw, ref, torch.bfloat16, "dW")


def _fp64_mm(a, b, counts):
    starts = [sum(counts[:e]) for e in range(len(counts))]
    return torch.cat([a[s:s + n].double() @ b[e].double()
                      for e, (s, n) in enumerate(zip(starts, counts))])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("r,c", [(1, 1), (3, 20), (20, 3), (36, 12), (8, 16), (17, 9)])
def test_grouped_gemms_at_any_width_layout_and_base_match_fp64(dtype, r, c):
    """Forward/dgrad (2d x 3d, both layouts of b) and wgrad (2d x 2d), every alignment,
    an operand whose base is off 16 bytes, and a rank with no rows at all."""
    g = torch.Generator().manual_seed(r * 100 + c)
    counts = [4, 0, 7, 1]
    rows = sum(counts)
    a = torch.randn(rows * r + 1, generator=g).to(dtype)[1:].view(rows, r)  # base + 1 elem
    w = torch.randn(4, c, r, generator=g).to(dtype)
    dev = torch.tensor(counts)
    for b in (w.transpose(1, 2), w.transpose(1, 2).contiguous()):  # [E, R, C] both ways
        assert_matches(grouped_mm(a, b, dev, counts), _fp64_mm(a, b, counts), dtype, "mm")
    dy = torch.randn(rows, c, generator=g).to(dtype)
    ref = torch.stack([dy[s:s + n].double().t() @ a[s:s + n].double()
                       for s, n in zip([0, 4, 4, 11], counts)])
    assert_matches(grouped_wgrad(dy, a, dev, counts), ref, dtype, "wgrad")
    none = [0, 0, 0, 0]
    assert grouped_mm(a[:0], w.transpose(1, 2), torch.tensor(none), none).shape == (0, c)
    assert torch.equal(grouped_wgrad(dy[:0], a[:0], torch.tensor(none), none),
                       torch.zeros(4, c, r, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accepts_says_which_layouts_torch_grouped_mm_takes(dtype):
    offs = torch.tensor([2, 5], dtype=torch.int32)
    for k in (1, 2, 3, 4, 6, 8, 12, 16, 20, 36):
        for a in (torch.zeros(5, k, dtype=dtype), torch.zeros(k, 5, dtype=dtype).t()):
            b = torch.zeros(2, a.shape[1], 8, dtype=dtype)
            try:
                torch._grouped_mm(a, b, offs=offs)
                taken = True
            except RuntimeError as err:
                assert "16 bytes" in str(err) or "strides" in str(err).lower()
                taken = False
            assert accepts(a) == taken, (k, a.stride())


def test_backward_is_two_grouped_gemms_whatever_the_expert_count(monkeypatch):
    """dgrad and wgrad are one torch._grouped_mm call each, not a loop over experts."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm",
                        lambda *a, **kw: calls.append(a[1].dim()) or real(*a, **kw))
    for experts in (3, 12):
        p = routed_problem(0, 1, tokens=32, experts=experts, topk=2, ffn=16, hidden=36)
        x = p["x"].clone().requires_grad_(True)
        w = p["weight"].clone().requires_grad_(True)
        out = gemm2_gather_rs(x, w, p["counts"], p["token_index"], 32, 2,
                              config=OverlapConfig(backend="reference"))
        calls.clear()
        out.sum().backward()
        assert sorted(calls) == [2, 3], experts  # wgrad (2d x 2d), dgrad (2d x 3d)


# ----------------------------------------------------------------- two ranks (gloo)
def _two_rank_grads(rank, world):
    import torch.distributed as dist

    results = {}
    for backend, dtype, hidden, ffn, ep in (("reference", torch.bfloat16, 36, 20, 2),
                                            ("interpret", torch.bfloat16, 36, 16, 1),
                                            ("reference", torch.float32, 38, 18, 1)):
        tokens = 24
        p = routed_problem(rank, world, tokens=tokens, experts=6, topk=2, ffn=ffn,
                           hidden=hidden, ep=ep, dtype=dtype, empty=(1,), seed=7)
        # every rank draws every rank's output gradient: the all-gather's result
        grads = [torch.randn(tokens // world, hidden,
                             generator=torch.Generator().manual_seed(20 + r)).to(dtype)
                 for r in range(world)]
        leaves = dict(x=p["x"], w=p["weight"], probs=p["probs"])
        config = OverlapConfig(backend=backend)

        def ours(x, w, probs):
            return gemm2_gather_rs(x, w, p["counts"], p["token_index"], tokens, 2, probs,
                                   dist.group.WORLD, config=config)

        def ref(x, w, probs):
            return fp64_partial(x, w, p["counts"].tolist(), p["token_index"], tokens, probs)

        _, got = op_grads(leaves, ours, grads[rank])
        want = fp64_grads(leaves, ref, torch.cat(grads))
        # (as lists: tensors would cross processes as file descriptors of exiting workers)
        results[(backend, str(dtype), hidden, ffn, ep)] = {
            k: (got[k].double().tolist(), want[k].tolist()) for k in leaves}
    return results


def test_two_ranks_gradients_through_the_all_gather_match_fp64_at_unaligned_widths():
    for res in run_ranks(2, _two_rank_grads):
        for case, pairs in res.items():
            dtype = getattr(torch, case[1].removeprefix("torch."))
            for k, (got, want) in pairs.items():
                assert_matches(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), dtype, f"{case} {k}")
