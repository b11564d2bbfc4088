"""ops' public helper kernels (ops/helpers.py): the kernels' results, and clear errors
naming the argument where a call cannot run."""

import pytest
import torch

from megatron_overlap import ops
from megatron_overlap.kernels import gated_add, gather_rows, swiglu
from megatron_overlap.ops import config as config_module


def test_helpers_return_what_their_references_compute():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(5, 32, generator=g)
    index = torch.tensor([4, 0, 2, 2, 1, 3])
    valid = torch.tensor([4])
    assert torch.equal(ops.gather_rows(src, index, valid)[:4],
                       gather_rows.gather_rows_reference(src, index, valid))
    inter, probs = torch.randn(6, 64, generator=g), torch.rand(6, generator=g)
    torch.testing.assert_close(ops.weighted_swiglu(inter, probs),
                               swiglu.weighted_swiglu_reference(inter, probs))
    out, shared, logit = torch.randn(6, 32, generator=g), torch.randn(6, 32), torch.randn(6)
    want = gated_add.add_gated_shared_reference(out, shared, logit)
    assert ops.add_gated_shared_(out, shared, logit) is out
    torch.testing.assert_close(out, want)
    assert ops.interpreting() and not ops.capturing(out)  # (conftest: CPU, interpreter)


def test_a_non_tensor_argument_is_a_type_error_naming_it():
    x = torch.zeros(4, 8)
    with pytest.raises(TypeError, match="gather_rows: index must be a torch.Tensor, got list"):
        ops.gather_rows(x, [0, 1], torch.tensor([2]))
    with pytest.raises(TypeError, match="weighted_swiglu: valid_rows must be a torch.Tensor"):
        ops.weighted_swiglu(x, torch.ones(4), valid_rows=3)
    with pytest.raises(TypeError, match="add_gated_shared_: logit must be a torch.Tensor"):
        ops.add_gated_shared_(x, x.clone(), 0.5)
    with pytest.raises(TypeError, match="capturing: t must be a torch.Tensor"):
        ops.capturing(None)


def test_cpu_tensors_without_the_interpreter_are_refused_naming_the_argument(monkeypatch):
    monkeypatch.setattr(config_module, "interpreting", lambda: False)
    assert not ops.interpreting()
    with pytest.raises(ValueError, match="weighted_swiglu: inter is on cpu.*TRITON_INTERPRET"):
        ops.weighted_swiglu(torch.zeros(4, 8), torch.ones(4))


def test_the_kernels_own_checks_still_name_the_argument():
    with pytest.raises(ValueError, match="index must be int64"):
        ops.gather_rows(torch.zeros(4, 8), torch.tensor([0], dtype=torch.int32),
                        torch.tensor([1]))
    with pytest.raises(ValueError, match="inter must be"):
        ops.weighted_swiglu(torch.zeros(4, 7), torch.ones(4))


@pytest.mark.parametrize("name, bad, match", [
    ("num_tokens", 0, "num_tokens must be an int >= 1"), ("ffn", 1.5, "ffn must be an int"),
    ("local_experts", 8, r"local_experts \(8\) must be <= experts \(4\)"),
    ("fp8", "mxfp8", r"fp8 must be None or one of \('tensor', 'block'\)")])
def test_fusion_decision_names_the_bad_size(name, bad, match):
    import torch

    from megatron_overlap.ops import OverlapConfig, fusion_decision

    sizes = dict(num_tokens=64, hidden=32, ffn=16, topk=2, local_experts=4, experts=4,
                 dtype=torch.float32, device=torch.device("cpu"),
                 config=OverlapConfig(backend="reference"))
    with pytest.raises((TypeError, ValueError), match=match):
        fusion_decision(**dict(sizes, **{name: bad}))
