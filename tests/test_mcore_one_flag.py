"""`--moe-overlap` alone: every MoE layer of every model Megatron-LM's builders make.

Megatron-LM core_v0.19's scripts parse with our provider (as the launcher gives it) and
build through megatron.training's `GPTModelBuilder` / `HybridModelBuilder` or the older
`get_model(model_provider)`; no `--spec` of ours. Checked on one gloo rank (CPU, the
reference backend unless a case needs a Triton one): every MoE layer is an OverlapMoELayer
over Megatron's own experts and dispatcher object (GPT from Megatron's spec choice, the
MTP block, HybridModel, TE spec through tests/megatron_te_double.py), the build line says
so, forward + backward equal the stock model's with the same weights; what cannot fuse
(another dispatcher, a width the op cannot read) is reported at build and is an error
with `--moe-overlap-strict`; our own spec is never wrapped twice; a calibration that does
not exist is an argparse error naming the flag. Shims: tests/mcore_shims.py.
"""

import argparse
import contextlib
import io
import sys

import pytest
import torch

from dist_harness import run_ranks
from test_megatron_lm_launch import SMALL as LAUNCH_SMALL

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")

#: test_megatron_lm_launch's small line, without biases (Megatron's TE MoE with biases
#: needs --no-bias-dropout-fusion; the recipes' models have none)
SMALL = [*LAUNCH_SMALL, "--disable-bias-linear"]
LOCAL = ["--transformer-impl", "local", "--no-persist-layer-norm"]
OVERLAP = ["--moe-overlap", "--moe-overlap-backend", "reference"]


# ---------------------------------------------------------------- in the rank
def _local_hybrid_stack_spec():
    """Megatron's `hybrid_stack_spec` with its attention and MoE layers built from the
    local GPT layer spec (its own binds TE's classes at import, which CPU lacks)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (MoETransformerLayer,
                                                             TransformerLayer,
                                                             TransformerLayerSubmodules)

    local = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False).submodules
    attention = TransformerLayerSubmodules(input_layernorm=local.input_layernorm,
                                           self_attention=local.self_attention,
                                           self_attn_bda=local.self_attn_bda)
    moe = TransformerLayerSubmodules(pre_mlp_layernorm=local.pre_mlp_layernorm,
                                     mlp=local.mlp, mlp_bda=local.mlp_bda)
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=moe)))


def _parse(argv, script="pretrain_gpt.py"):
    """Megatron-LM's parse_and_validate_args as its scripts call it, our provider given
    as the launcher gives it (which also hooks the builders)."""
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_overlap.mcore import moe_overlap_args_provider

    unset_global_variables()
    destroy_num_microbatches_calculator()
    sys.argv = [script, *argv]
    return parse_and_validate_args(extra_args_provider=moe_overlap_args_provider(None),
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


def _pg(args):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def _build(argv, kind="gpt"):
    """(model, the lines printed at build) as the script of `kind` builds it."""
    from megatron.training.argument_utils import gpt_config_from_args, hybrid_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder
    from megatron.training.models.hybrid import HybridModelBuilder

    args = _parse(argv, "pretrain_hybrid.py" if kind == "hybrid" else "pretrain_gpt.py")
    pg = _pg(args)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        if kind == "hybrid":
            model = HybridModelBuilder(hybrid_config_from_args(args)).build_model(pg)
        elif kind == "get_model":
            model = _get_model(args)
        else:
            model = GPTModelBuilder(gpt_config_from_args(args)).build_model(pg)
    return model, [line for line in printed.getvalue().splitlines() if "megatron-overlap" in line]


def _get_model(args):
    """The older path: `training.get_model(model_provider)` (no DDP wrap here)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training import training
    from megatron.training.arguments import core_transformer_config_from_args

    def model_provider(pre_process=True, post_process=True, vp_stage=None, **unused):
        config = core_transformer_config_from_args(args)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=args.normalization)
        return GPTModel(config=config, transformer_layer_spec=spec,
                        vocab_size=args.padded_vocab_size,
                        max_sequence_length=args.max_position_embeddings)

    cuda = torch.nn.Module.cuda
    torch.nn.Module.cuda = lambda self, device=None: self  # (CPU: get_model moves to CUDA)
    try:
        return training.get_model(model_provider, wrap_with_ddp=False)[0]
    finally:
        torch.nn.Module.cuda = cuda


def _moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def _kinds(model):
    return [(type(m).__name__, type(m.experts).__name__, type(m.token_dispatcher).__name__)
            for _, m in _moe_layers(model)]


def _step(model, seed=11, vocab=255, seq=64):
    """One forward + backward: (per-token loss, {parameter name: gradient})."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    labels = torch.randint(0, vocab, (2, seq), generator=g)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, torch.arange(seq).expand(2, seq), None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _case(argv, kind="gpt"):
    """Overlapped and stock builds of one line: classes, build lines, and the overlapped
    model's loss and gradients against the stock one's with the same weights."""
    model, printed = _build(argv + OVERLAP, kind)
    stock, stock_printed = _build(argv, kind)
    stock.load_state_dict(model.state_dict())
    (loss, grads), (ref_loss, ref_grads) = _step(model), _step(stock)
    return dict(kinds=_kinds(model), stock=_kinds(stock), printed=printed,
                stock_printed=stock_printed, names=[n for n, _ in _moe_layers(model)],
                fused=[m.last_rows is not None for _, m in _moe_layers(model)],
                loss=_rel(loss, ref_loss), same_grads=sorted(grads) == sorted(ref_grads),
                grads=max(_rel(grads[k], ref_grads[k]) for k in ref_grads))


def _refusals():
    """What cannot fuse, at build: another dispatcher, a width the op cannot read."""
    from megatron_overlap.mcore import OverlapBuildError

    found = {}
    alltoall = [a if a != "allgather" else "alltoall" for a in SMALL] + LOCAL
    model, found["alltoall_printed"] = _build(alltoall + OVERLAP)
    found["alltoall_kinds"] = _kinds(model)
    narrow = [a if a != "32" else "18" for a in SMALL] + LOCAL  # 18 x 4 B: not 16-byte rows
    interpret = ["--moe-overlap", "--moe-overlap-backend", "interpret"]
    model, found["narrow_printed"] = _build(narrow + interpret)
    found["narrow_forward"] = float(_step(model)[0].mean())  # the stock path, no error
    for name, argv in (("alltoall_strict", alltoall + OVERLAP),
                       ("narrow_strict", narrow + interpret)):
        try:
            _build(argv + ["--moe-overlap-strict"])
            found[name] = None
        except OverlapBuildError as err:
            found[name] = str(err)
    return found


def _explicit_groups():
    """A layer given its process groups (as Megatron 0.19 and its own dispatcher tests
    build it) uses them and never asks for the global defaults."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_layer
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_overlap.mcore import with_overlap_moe
    from megatron_overlap.ops import OverlapConfig

    args = _parse(SMALL + LOCAL)
    pg = _pg(args)
    spec = with_overlap_moe(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
                            .submodules.mlp, OverlapConfig(backend="reference"))

    def no_defaults():
        raise AssertionError("the default process groups were asked for")

    default, moe_layer.get_default_pg_collection = moe_layer.get_default_pg_collection, no_defaults
    try:
        layer = spec(config=core_transformer_config_from_args(args), pg_collection=pg)
        out, _ = layer(torch.randn(8, 1, 64))
    finally:
        moe_layer.get_default_pg_collection = default
    return dict(dispatcher=type(layer.token_dispatcher).__name__, fused=layer.last_rows is not None,
                groups=layer.token_dispatcher.tp_ep_group is pg.tp_ep, shape=tuple(out.shape))


def _scenarios(rank, world):
    import mcore_shims

    mcore_shims.install()
    mcore_shims.install_megatron_training()
    res = {"local": _case(SMALL + LOCAL), "get_model": _case(SMALL + LOCAL, "get_model"),
           "mtp": _case(SMALL + LOCAL + ["--mtp-num-layers", "1", "--position-embedding-type",
                                             "rope", "--no-rope-fusion"])}
    ours = ["--spec", "megatron_overlap.mcore", "moe_overlap_gpt_spec"]
    model, res["our_spec_printed"] = _build(SMALL + LOCAL + ours + OVERLAP)
    res["our_spec_kinds"] = _kinds(model)
    res.update(_refusals())
    res["explicit_groups"] = _explicit_groups()
    import megatron_te_double

    megatron_te_double.install()
    res["te"] = _case(SMALL)
    from megatron.core.models.hybrid import hybrid_block

    hybrid_block.TENorm = megatron_te_double.NormDouble  # (its final norm is always TE's)
    # (`--spec test_mcore_one_flag LOCAL_HYBRID_STACK_SPEC`: this module, as imported here)
    globals()["LOCAL_HYBRID_STACK_SPEC"] = _local_hybrid_stack_spec()
    hybrid = ["--spec", "test_mcore_one_flag", "LOCAL_HYBRID_STACK_SPEC",
              "--hybrid-layer-pattern", "*E*E"]
    res["hybrid"] = _case(SMALL[2:] + LOCAL + hybrid, "hybrid")
    try:
        _build(SMALL[2:] + LOCAL + ours + OVERLAP
               + ["--hybrid-layer-pattern", "*E"], "hybrid")
        res["hybrid_gpt_spec"] = None
    except ValueError as err:
        res["hybrid_gpt_spec"] = str(err)
    return res


@pytest.fixture(scope="module")
def runs():
    return run_ranks(1, _scenarios)[0]


# ---------------------------------------------------------------- claims
@pytest.mark.parametrize("case", ["local", "get_model", "te", "mtp", "hybrid"])
def test_the_flag_alone_overlaps_every_moe_layer_and_matches_stock(runs, case):
    r = runs[case]
    assert r["kinds"] and all(k[0] == "OverlapMoELayer" for k in r["kinds"]), r
    assert all(k[2] == "OverlapAllGatherDispatcher" for k in r["kinds"]), r
    assert [k[1] for k in r["kinds"]] == [k[1] for k in r["stock"]], r  # Megatron's experts
    assert all(k[0] == "MoELayer" for k in r["stock"]) and r["stock_printed"] == [], r
    assert all(r["fused"]), r
    assert r["same_grads"] and r["loss"] < 1e-5 and r["grads"] < 1e-4, r


@pytest.mark.parametrize("case", ["local", "get_model", "te", "mtp", "hybrid"])
def test_the_build_line_counts_the_overlapped_layers(runs, case):
    r = runs[case]
    n = len(r["kinds"])
    assert r["printed"] == [f"megatron-overlap: {n} of {n} MoE layers overlapped "
                            f"({r['kinds'][0][1]} experts, OverlapAllGatherDispatcher)"], r


def test_the_mtp_blocks_moe_layer_is_overlapped(runs):
    names = runs["mtp"]["names"]
    assert len(names) == 3 and any(name.startswith("mtp.") for name in names), names


def test_the_te_line_keeps_megatrons_te_grouped_experts(runs):
    assert {k[1] for k in runs["te"]["kinds"]} == {"TEGroupedMLP"}


def test_our_spec_with_the_flag_is_not_wrapped_twice(runs):
    assert runs["our_spec_kinds"] == [("OverlapMoELayer", "GroupedGemmExperts",
                                       "OverlapAllGatherDispatcher")] * 2
    assert runs["our_spec_printed"] == ["megatron-overlap: 2 of 2 MoE layers overlapped "
                                        "(GroupedGemmExperts experts, OverlapAllGatherDispatcher)"]


def test_another_dispatcher_is_reported_stock_at_build_and_strict_refuses_it(runs):
    assert [k[2] for k in runs["alltoall_kinds"]] == ["MoEAlltoAllTokenDispatcher"] * 2
    (line,) = runs["alltoall_printed"]
    assert line.startswith("megatron-overlap: 0 of 2 MoE layers overlapped; stock: "), line
    assert ("decoder.layers.0.mlp, decoder.layers.1.mlp (the MoEAlltoAllTokenDispatcher "
            "dispatcher (only allgather is fused))") in line, line
    assert "--moe-overlap-strict: 2 of 2 MoE layers" in runs["alltoall_strict"]


def test_a_width_the_op_cannot_read_runs_stock_from_build_not_an_error_at_forward(runs):
    (line,) = runs["narrow_printed"]
    assert "an expert FFN width of 18 per rank in float32 (72 B a row" in line, line
    assert runs["narrow_forward"] == pytest.approx(runs["narrow_forward"])  # (finite)
    assert "an expert FFN width of 18" in runs["narrow_strict"]


def test_the_layer_uses_the_process_groups_megatron_gives_it(runs):
    assert runs["explicit_groups"] == dict(dispatcher="OverlapAllGatherDispatcher", fused=True,
                                           groups=True, shape=(8, 1, 64))


def test_our_gpt_spec_in_a_hybrid_script_is_a_clear_error(runs):
    err = runs["hybrid_gpt_spec"]
    assert err is not None and "hybrid_stack_spec" in err and "--moe-overlap alone" in err


# ---------------------------------------------------------------- at parse time
@pytest.mark.parametrize("value, message", [
    ("b200", "unknown calibration preset 'b200'; shipped: "),
    ("/nonexistent/cal.json", "calibration file '/nonexistent/cal.json'"),
])
def test_a_calibration_that_does_not_exist_is_an_argparse_error_naming_the_flag(
        value, message, capsys):
    from megatron_overlap.mcore import add_moe_overlap_args

    parser = add_moe_overlap_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-overlap", "--moe-overlap-calibration", value])
    err = capsys.readouterr().err
    assert "argument --moe-overlap-calibration" in err and message in err, err
    assert parser.parse_args(["--moe-overlap-calibration", "h200"]).moe_overlap_calibration == "h200"


def _adopt_again():
    """A layer adopted again decides its support again: a width the Triton backends cannot
    read runs stock there and fuses on the reference backend."""
    from megatron_overlap.mcore import overlap_moe_layers
    from megatron_overlap.ops import OverlapConfig

    narrow = [a if a != "32" else "18" for a in SMALL] + LOCAL
    model, _ = _build(narrow + ["--moe-overlap", "--moe-overlap-backend", "interpret"])
    again = overlap_moe_layers(model, OverlapConfig(backend="reference"))
    return dict(stock=len(again.stock), overlapped=len(again.overlapped),
                fused=_step(model) is not None and all(
                    m.last_rows is not None for _, m in _moe_layers(model)))


def test_a_layer_adopted_again_decides_its_support_again():
    r = run_ranks(1, _adopt_again_worker)[0]
    assert r == dict(stock=0, overlapped=2, fused=True), r


def _adopt_again_worker(rank, world):
    import mcore_shims

    mcore_shims.install()
    mcore_shims.install_megatron_training()
    return _adopt_again()


@pytest.mark.parametrize("model", [None, [], "model", [torch.nn.Linear(2, 2), 3]])
def test_overlap_moe_layers_refuses_what_is_not_a_module_naming_the_argument(model):
    from megatron_overlap.mcore import overlap_moe_layers

    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        overlap_moe_layers(model)


def test_overlap_moe_layers_refuses_a_config_of_another_type():
    from megatron_overlap.mcore import overlap_moe_layers

    with pytest.raises(ValueError, match="overlap_config must be an OverlapConfig"):
        overlap_moe_layers(torch.nn.Linear(2, 2), overlap_config="interpret")
