"""The host-cost counter of the prefill launcher (`mcore.host_costs`)."""

import torch, pytest
from megatron_overlap.mcore import host_costs

def test_measure_host_costs_attributes_waits_to_the_moe_layer_they_happen_in(monkeypatch):
    """A counts wait inside an MoE layer's forward counts for that call; one outside
    counts for the step only; a model without MoE layers is refused."""
    class Layer(torch.nn.Module):
        def forward(self, x):
            host_costs.dispatch.Deferred.tokens_per_expert(None)
            return x
    monkeypatch.setattr(host_costs, "overlap_layers",
                        lambda m: [x for x in m.modules() if isinstance(x, Layer)])
    monkeypatch.setattr(host_costs.dispatch.Deferred, "tokens_per_expert", lambda self: None)
    model = torch.nn.Sequential(Layer(), Layer())

    def step():
        model(torch.ones(1))
        host_costs.dispatch.Deferred.tokens_per_expert(None)  # (the rest of the step)
    c = host_costs.measure_host_costs(model, step)
    assert (c.calls, c.syncs_per_call, c.step_syncs) == (2, 1.0, 3) and c.host_us_per_call > 0
    with pytest.raises(ValueError, match="no OverlapMoELayer"):
        host_costs.measure_host_costs(torch.nn.Linear(1, 1), step)


def test_host_syncs_counts_the_waits_of_any_callable(monkeypatch):
    monkeypatch.setattr(host_costs.dispatch.Deferred, "tokens_per_expert", lambda self: None)

    def two_waits():
        host_costs.dispatch.Deferred.tokens_per_expert(None)
        host_costs.dispatch.Deferred.tokens_per_expert(None)
        return "out"
    assert host_costs.host_syncs(two_waits) == ("out", 2)
