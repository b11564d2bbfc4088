"""Spec helpers, `--moe-overlap` flags, model builders and the prefill launcher on CPU.

Spec rewriting runs in this process (no weights); everything that builds a model runs in
one spawned group of 2 gloo ranks (Megatron imported once per rank).
"""

import argparse
import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks

from megatron_overlap.planner.presets import CALIBRATION_DIR

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")
ARCHS = ("granite", "qwen", "deepseek")
MOE_PATH = ("megatron.core.transformer.moe.moe_layer", "MoELayer")  # the <= 0.17 tuple form


@pytest.fixture(scope="module")
def mc():
    """The Megatron-touching modules, imported once (several seconds)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_overlap.mcore import models, spec
    from megatron_overlap.mcore.experts import GroupedGemmExperts
    from megatron_overlap.mcore.layer import OverlapMoELayer
    from megatron_overlap.ops import OverlapConfig

    return argparse.Namespace(MoELayer=MoELayer, MoESubmodules=MoESubmodules,
                              ModuleSpec=ModuleSpec, models=models, spec=spec,
                              GroupedGemmExperts=GroupedGemmExperts,
                              OverlapMoELayer=OverlapMoELayer, OverlapConfig=OverlapConfig)


def _builder_specs(mc):
    for name in ARCHS:
        config, _ = mc.models.model_config(name, 2, 2)
        for experts in ("grouped", "sequential"):
            yield name, config, mc.models.model_spec(config, experts=experts, pp_rank=0)


def _mlps(block):
    return [layer.submodules.mlp for layer in block.layer_specs]


def test_spec_helper_swaps_every_moe_layer_of_every_builder_spec(mc):
    cfg = mc.OverlapConfig(backend="reference", comm_ctas=5)
    for name, config, block in _builder_specs(mc):
        swapped = mc.spec.with_overlap_moe(block, cfg)
        assert len(swapped.layer_specs) == config.num_layers
        for i, (old, new) in enumerate(zip(_mlps(block), _mlps(swapped))):
            dense = isinstance(config.moe_layer_freq, list) and config.moe_layer_freq[i] == 0
            if dense:  # DeepSeek-V2-Lite's first layer keeps its dense FFN
                assert new is old
                continue
            assert old.func is mc.MoELayer, (name, i)  # the input spec is not modified
            assert new.func is mc.OverlapMoELayer and new.keywords["overlap_config"] is cfg
            assert new.keywords["submodules"] is old.keywords["submodules"]


def test_builder_specs_use_grouped_experts_unless_sequential_is_asked(mc):
    for name, _, block in _builder_specs(mc):
        experts = {n.keywords["submodules"].experts for n in mc.spec.moe_layer_specs(block)}
        assert len(experts) == 1
        kind = experts.pop()
        assert kind is mc.GroupedGemmExperts or kind.func.__name__ == "SequentialMLP", name


def _module_spec_form(mc, block):
    """The same layers in megatron-core <= 0.17's form: MoE as a ModuleSpec, one of them
    with the module named by an import path."""
    layers = []
    for i, layer in enumerate(block.layer_specs):
        mlp = layer.submodules.mlp
        if isinstance(mlp, functools.partial) and mlp.func is mc.MoELayer:
            module = mc.MoELayer if i % 2 else MOE_PATH
            mlp = mc.ModuleSpec(module=module, submodules=mlp.keywords["submodules"])
        sub = type(layer.submodules)(**{**vars(layer.submodules), "mlp": mlp})
        layers.append(mc.ModuleSpec(module=layer.module, submodules=sub, params=layer.params))
    return layers


def test_spec_helper_handles_the_module_spec_form(mc):
    from megatron_overlap.mcore import LayerPolicy

    cfg, policy = mc.OverlapConfig(backend="reference"), LayerPolicy(fuse="always")
    for name, config, block in _builder_specs(mc):
        layers = _module_spec_form(mc, block)
        swapped = mc.spec.with_overlap_moe(layers, cfg, policy)
        grouped = mc.spec.with_grouped_experts(layers)
        moe = [i for i, layer in enumerate(layers)
               if isinstance(layer.submodules.mlp, mc.ModuleSpec)]
        assert moe, name
        for i in moe:
            new = swapped[i].submodules.mlp
            assert new.module is mc.OverlapMoELayer
            assert new.params == {"overlap_config": cfg, "policy": policy}
            assert grouped[i].submodules.mlp.submodules.experts is mc.GroupedGemmExperts
            assert layers[i].submodules.mlp.module in (mc.MoELayer, MOE_PATH)


def test_spec_without_moe_layers_comes_back_unchanged(mc):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    dense = get_gpt_layer_local_spec()
    assert mc.spec.with_overlap_moe(dense) is dense


def test_custom_moe_subclass_is_refused_with_a_clear_error(mc):
    class MyMoE(mc.MoELayer):
        pass

    _, _, block = next(_builder_specs(mc))
    node = mc.spec.moe_layer_specs(block)[0]
    custom = functools.partial(MyMoE, **node.keywords)
    with pytest.raises(ValueError, match="MyMoE"):
        mc.spec.with_overlap_moe(custom)
    with pytest.raises(ValueError, match="OverlapConfig"):
        mc.spec.with_overlap_moe(node, overlap_config="triton")


def test_builder_moe_shapes_agree_with_shapes_module(mc):
    from megatron_overlap.shapes import MODELS

    for name in ARCHS:
        config, _ = mc.models.model_config(name)
        shape = MODELS[name]
        ours = (config.hidden_size, config.moe_ffn_hidden_size, config.num_moe_experts,
                config.moe_router_topk)
        assert ours == (shape.hidden, shape.expert_ffn, shape.experts, shape.topk)
    with pytest.raises(ValueError, match="does not divide"):
        mc.models.model_config("qwen", 1, 8)  # 60 experts


# ---------------------------------------------------------------- flags
def _parse(argv):
    from megatron_overlap.mcore import add_moe_overlap_args

    return add_moe_overlap_args(argparse.ArgumentParser()).parse_args(argv)


def test_flags_parse_into_the_overlap_config_and_the_layer_policy(tmp_path):
    from megatron_overlap.mcore import (LayerPolicy, layer_policy_from_args,
                                        overlap_config_from_args)
    from megatron_overlap.ops import OverlapConfig

    cal = tmp_path / "h200.json"  # (a calibration file must load at parse time)
    shutil.copy(CALIBRATION_DIR / "h200.json", cal)
    cfg = overlap_config_from_args(_parse([
        "--moe-overlap", "--moe-overlap-comm-ctas", "8", "--moe-overlap-splits", "auto",
        "--moe-overlap-backend", "reference", "--moe-overlap-calibration", str(cal)]))
    assert (cfg.comm_ctas, cfg.splits, cfg.backend, cfg.preset) == (8, None, "reference", str(cal))
    auto = overlap_config_from_args(_parse(["--moe-overlap"]))
    assert (auto.comm_ctas, auto.splits, auto.backend, auto.preset) == (None, None, "auto", None)
    # the layer's own choices: a LayerPolicy beside the op's config
    assert layer_policy_from_args(_parse(["--moe-overlap"])) == LayerPolicy()
    assert LayerPolicy().fuse == "auto"  # the planner decides per size
    always = _parse(["--moe-overlap", "--moe-overlap-fuse", "always"])
    assert layer_policy_from_args(always).fuse == "always"
    assert overlap_config_from_args(always) == auto  # (the op's config does not change)
    plain = overlap_config_from_args(_parse(["--moe-overlap", "--moe-overlap-no-tail-helpers"]))
    assert plain.tail_helpers is False
    assert LayerPolicy().host_counts is False  # the counts stay on the device where they can
    assert layer_policy_from_args(_parse(["--moe-overlap", "--moe-overlap-host-counts"])
                                  ).host_counts is True
    assert layer_policy_from_args(argparse.Namespace()) == LayerPolicy()
    assert LayerPolicy().fp8 is False  # FP8 layers fuse only where asked
    assert layer_policy_from_args(_parse(["--moe-overlap", "--moe-overlap-fp8"])).fp8 is True
    with pytest.raises(ValueError, match="LayerPolicy.fp8 must be a bool"):
        LayerPolicy(fp8="yes")
    # blockwise only where asked as well (measured slower), and only beside fp8
    assert LayerPolicy(fp8=True).fp8_blockwise is False
    both = layer_policy_from_args(_parse(["--moe-overlap", "--moe-overlap-fp8",
                                          "--moe-overlap-fp8-blockwise"]))
    assert both.fp8 and both.fp8_blockwise
    with pytest.raises(ValueError, match="fp8_blockwise needs fp8=True"):
        LayerPolicy(fp8_blockwise=True)
    assert auto.placement == OverlapConfig().placement  # "auto": the device default
    part = overlap_config_from_args(_parse(["--moe-overlap", "--moe-overlap-placement",
                                            "partition"]))
    assert part.placement == "partition"
    assert overlap_config_from_args(_parse(["--moe-overlap-comm-ctas", "4"])) is None
    assert overlap_config_from_args(argparse.Namespace()) is None


@pytest.mark.parametrize("argv", [["--moe-overlap-comm-ctas", "0"], ["--moe-overlap-splits", "x"],
                                  ["--moe-overlap-backend", "cuda"],
                                  ["--moe-overlap-fuse", "never"]])
def test_bad_flag_values_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        _parse(argv)
    assert "moe-overlap" in capsys.readouterr().err


def test_layer_policy_names_the_bad_field():
    from megatron_overlap.mcore import LayerPolicy

    with pytest.raises(ValueError, match="LayerPolicy.fuse"):
        LayerPolicy(fuse="never")
    with pytest.raises(ValueError, match="LayerPolicy.host_counts must be a bool"):
        LayerPolicy(host_counts="yes")
    from megatron_overlap.mcore import with_overlap_moe

    with pytest.raises(ValueError, match="policy must be a LayerPolicy, got str"):
        with_overlap_moe([], None, "always")


def test_missing_calibration_file_raises_value_error(tmp_path):
    """(The flag itself refuses it at parse time: test_mcore_one_flag.py; a namespace made
    otherwise still gets a clear error.)"""
    from megatron_overlap.mcore import overlap_config_from_args

    with pytest.raises(ValueError, match="no such file"):
        overlap_config_from_args(argparse.Namespace(
            moe_overlap=True, moe_overlap_calibration=str(tmp_path / "none.json")))


def test_flags_do_not_collide_with_megatron_lm_arguments():
    import megatron

    text = (Path(megatron.__path__[0]) / "training" / "arguments.py").read_text()
    assert "'--spec'" in text  # the file is the one that defines Megatron-LM's flags
    for option in ("--moe-overlap", "--moe-overlap-comm-ctas", "--moe-overlap-splits",
                   "--moe-overlap-backend", "--moe-overlap-calibration"):
        assert f"'{option}'" not in text and f'"{option}"' not in text


# ---------------------------------------------------------------- models (2 ranks)
def _logits(model, rank_seed, vocab=256, seq=16):
    g = torch.Generator().manual_seed(rank_seed)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    with torch.no_grad():
        return model(tokens, torch.arange(seq).expand(2, seq), None)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _megatron_lm_args(overlap_argv):
    from megatron_overlap.mcore import add_moe_overlap_args

    p = add_moe_overlap_args(argparse.ArgumentParser())
    args = p.parse_args(overlap_argv)
    # the Megatron-LM arguments gpt_builders / our --spec resolution read
    args.transformer_impl, args.num_experts, args.normalization = "local", 8, "RMSNorm"
    args.qk_l2_norm = args.qk_layernorm = args.multi_latent_attention = False
    return args


def _model_scenarios(rank, world, json_path):
    import mcore_shims

    mcore_shims.install()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_overlap.mcore import build_model, prefill
    from megatron_overlap.mcore import spec as spec_mod
    from megatron_overlap.mcore.layer import OverlapMoELayer
    from megatron_overlap.mcore.models import model_config
    from megatron_overlap.ops import OverlapConfig

    res = {}
    for tp, ep in ((1, 2), (2, 1)):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        model_parallel_cuda_manual_seed(0)
        for name in ARCHS:
            outs = []
            for overlap in (None, OverlapConfig(backend="interpret")):
                torch.manual_seed(0)
                model = build_model(name, tp, ep, tiny=True, overlap=overlap).eval()
                outs.append(_logits(model, rank // tp))
            layers = [m for m in model.modules() if isinstance(m, OverlapMoELayer)]
            res[("forward", name, tp, ep)] = dict(
                shape=tuple(outs[0].shape), rel=_rel(outs[1], outs[0]),
                finite=bool(outs[0].isfinite().all()), moe_layers=len(layers),
                planned=all(layer.last_plan is not None for layer in layers))
        if tp == 2:  # SDPAttention is Megatron's local attention, computed by torch SDPA
            torch.manual_seed(0)
            local = _logits(build_model("granite", tp, ep, tiny=True, attention="local").eval(), 0)
            torch.manual_seed(0)
            sdpa = _logits(build_model("granite", tp, ep, tiny=True).eval(), 0)
            res["sdpa_vs_local"] = _rel(sdpa, local)

    # Megatron-LM path (TP1EP2, stock local spec): --spec resolution from args
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    config, _ = model_config("qwen", 1, 2, tiny=True)

    def gpt(spec):
        torch.manual_seed(0)
        return GPTModel(config, spec, vocab_size=256, max_sequence_length=64,
                        position_embedding_type="rope").eval()

    stock = gpt(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                           normalization="RMSNorm"))
    off = gpt(spec_mod.gpt_block_spec_from_args(_megatron_lm_args([]), config))
    argv = ["--moe-overlap", "--moe-overlap-backend", "reference", "--moe-overlap-comm-ctas", "7",
            "--moe-overlap-splits", "2", "--moe-overlap-fuse", "always"]
    lazy = spec_mod._ArgsBlockSpec()
    spec_mod._megatron_args_and_config = lambda: (_megatron_lm_args(argv), config)
    on = gpt(lazy)
    sd_s, sd_o = stock.state_dict(), off.state_dict()
    res["off"] = dict(
        types=[type(m) for m in stock.modules()] == [type(m) for m in off.modules()],
        keys=list(sd_s) == list(sd_o),
        values=all(torch.equal(v, sd_o[k]) for k, v in sd_s.items() if isinstance(v, torch.Tensor)),
        logits=torch.equal(_logits(stock, rank), _logits(off, rank)))
    layers = [m for m in on.modules() if isinstance(m, OverlapMoELayer)]
    res["on"] = dict(layers=len(layers), configs=[
        (c.backend, c.comm_ctas, c.splits) for c in (m.overlap_config for m in layers)],
        fuse=[m.policy.fuse for m in layers],
        rel=_rel(_logits(on, rank), _logits(stock, rank)))

    # the prefill launcher, ABBA on the same weights, tiny
    rc = prefill.main(["--model", "deepseek", "--tiny", "--tp", "1", "--ep", "2", "--batch", "2",
                       "--seq", "8", "--iters", "2", "--warmup", "1", "--abba",
                       "--host-costs", "--moe-overlap-backend", "interpret", "--preload", "mcore_shims",
                       "--json", json_path])
    res["prefill_rc"] = rc
    ps.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def model_runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill") / "prefill.json"
    ranks = run_ranks(2, _model_scenarios, str(path))
    return ranks, json.loads(path.read_text())


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("layout", [(1, 2), (2, 1)])
def test_tiny_model_forward_with_overlap_matches_stock(model_runs, name, layout):
    for rank, res in enumerate(model_runs[0]):
        r = res[("forward", name, *layout)]
        assert r["finite"] and r["planned"] and r["moe_layers"] >= 1, (rank, r)
        assert r["shape"] == (2, 16, 256 // layout[0]) and r["rel"] < 1e-5, (rank, r)


def test_sdpa_core_attention_matches_megatron_local_attention(model_runs):
    assert all(res["sdpa_vs_local"] < 1e-5 for res in model_runs[0])


def test_without_moe_overlap_the_model_is_bit_identical_to_stock(model_runs):
    for res in model_runs[0]:
        assert res["off"] == dict(types=True, keys=True, values=True, logits=True)


def test_flags_reach_every_moe_layer_through_the_spec(model_runs):
    for res in model_runs[0]:
        on = res["on"]
        assert on["layers"] == 2 and set(on["configs"]) == {("reference", 7, 2)}
        assert on["fuse"] == ["always", "always"]  # the layer's own flag, its LayerPolicy
        assert on["rel"] < 1e-5


def test_prefill_launcher_times_both_policies_and_reports_decisions(model_runs):
    ranks, result = model_runs
    assert all(res["prefill_rc"] == 0 for res in ranks)
    assert set(result["policies"]) == {"stock", "overlap"} and result["tokens"] == 16
    for policy in result["policies"].values():
        assert len(policy["samples_ms"]) == 2 and policy["median_ms"] > 0
    decisions = result["decisions_rank0"]
    assert [d["layer"] for d in decisions] == [2]  # layer 1 is DeepSeek's dense FFN
    assert decisions[0]["C"] >= 1 and decisions[0]["L"] >= 1
    # this rank's 4 of tiny DeepSeek's 8 experts got some of the 16 tokens x top-3 rows
    d = decisions[0]
    assert 0 < d["max_e"] <= d["rows"] <= 16 * 3
    assert d["max_over_mean"] == round(d["max_e"] * 4 / d["rows"], 2) >= 1


def test_prefill_launcher_counts_host_syncs_and_time_per_moe_layer_call(model_runs):
    # one more step per policy; tiny DeepSeek has one MoE layer; on CPU nothing syncs
    costs = model_runs[1]["host_costs"]
    assert set(costs) == {"stock", "overlap"}
    for c in costs.values():
        assert c["calls"] == 1 and c["host_us_per_call"] > 0
        assert c["syncs_per_call"] == 0 and c["step_syncs"] == 0
