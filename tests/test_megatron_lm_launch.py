"""A Megatron-LM launch that engages: Megatron-LM's own parser and builder, on CPU.

Megatron-LM's `pretrain_gpt.py` (core_v0.19) parses its flags with
`megatron.training.arguments.parse_and_validate_args(extra_args_provider=...)`, turns them
into a `GPTModelConfig` (`gpt_config_from_args`, which imports the `--spec` object) and
builds each model chunk with `GPTModelBuilder.build_model`; its older `gpt_builders.py`
hands the `--spec` object to `GPTModel` directly. Both paths run here on one gloo rank with
real argument lines, against the stock model built from the same line without
`--moe-overlap` (same weights): the layer classes, no fallback warning, every MoE layer
running the op, a forward + backward within fp32 tolerance.

Test-only shims (tests/mcore_shims.py says why): `typing.override` on Python 3.11
(megatron.training imports it; megatron-core 0.19 declares 3.12, whose venv here would pull
the multi-GB CUDA torch), `torch.cuda.get_device_capability` on CPU (validate_args asks it
for `--moe-grouped-gemm`), the CUDA call sites of `install()`. The TE-default line
(`--transformer-impl transformer_engine`, Megatron-LM's default) runs Megatron's TE spec
code with TE's modules replaced by CPU doubles (tests/megatron_te_double.py); the same line
with real TE is tests/test_megatron_lm_launch_gpu.py.

The recipes are checked too: every recipes/*.sh, run with a stand-in `torchrun`, gives an
argument line that Megatron-LM's parser takes with our provider and whose model is the one
models.py builds.
"""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backends")
REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.sh"))
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4))
#: the Megatron-LM script of each recipe that does not run pretrain_gpt.py
SCRIPTS = {"qwen_hybrid": "pretrain_hybrid.py"}

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
         "--moe-grouped-gemm", "--moe-token-dispatcher-type", "allgather",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
         "--swiglu", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
         # CPU only: Megatron's compiled SwiGLU and gradient-accumulation fusion need CUDA
         "--no-bias-swiglu-fusion", "--no-gradient-accumulation-fusion",
         "--use-cpu-initialization"]
SPEC = ["--spec", "megatron_overlap.mcore", "moe_overlap_gpt_spec"]
OVERLAP = ["--moe-overlap", "--moe-overlap-backend", "reference"]
LINES = {
    # torch's norms cannot persist (Megatron-LM's default --persist-layer-norm is TE's/apex's)
    "local": ["--transformer-impl", "local", "--no-persist-layer-norm"],
    # Megatron-LM's defaults: TE, biases on; TEGroupedMLP with biases refuses Megatron's
    # bias-dropout fusion (its own assertion), so a biased TE MoE line turns it off
    "te": ["--no-bias-dropout-fusion"],
}


# ---------------------------------------------------------------- in the rank
def _modelopt_standin(parser):
    """What pretrain_gpt.py passes where modelopt is installed: its own flags."""
    parser.add_argument_group("stand-in").add_argument("--standin-flag", type=int, default=0)
    return parser


def _parse(argv):
    """Megatron-LM's parse_and_validate_args as pretrain_gpt.py calls it (argv as torchrun
    gives it), our provider composed with another one."""
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    from megatron_overlap.mcore import moe_overlap_args_provider

    unset_global_variables()
    destroy_num_microbatches_calculator()
    sys.argv = ["pretrain_gpt.py", *argv]
    return parse_and_validate_args(
        extra_args_provider=moe_overlap_args_provider(_modelopt_standin),
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


def _build(args, path="builder"):
    """The model pretrain_gpt.py builds: core_v0.19's GPTModelBuilder from
    gpt_config_from_args, or ("gpt_builder") the older gpt_builders.py's GPTModel call."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_overlap.mcore import moe_overlap_gpt_spec

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(args.tensor_model_parallel_size, 1,
                                 expert_model_parallel_size=args.expert_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    if path == "builder":
        return GPTModelBuilder(gpt_config_from_args(args)).build_model(
            ProcessGroupCollection.use_mpu_process_groups())
    moe_overlap_gpt_spec._resolved = None  # (it resolves once per process: a new line here)
    config = core_transformer_config_from_args(args)
    spec = import_module(args.spec) if args.spec is not None else None
    assert spec is not None or path == "gpt_builder_stock"
    if spec is None:  # gpt_builders' own choice without --spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=(
            args.transformer_impl == "transformer_engine"), normalization=args.normalization)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=True,
                    post_process=True, parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                    rope_scaling=args.use_rope_scaling)


def _moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def _step(model, seed=11, vocab=255, seq=64, backward=True):
    """One forward + backward: (per-token loss, {parameter name: gradient})."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, seq), generator=g)
    labels = torch.randint(0, vocab, (2, seq), generator=g)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, torch.arange(seq).expand(2, seq), None, labels=labels)
    if not backward:
        return loss, {}
    loss.sum().backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _compare(overlap, stock):
    """Overlapped vs stock (weights copied from the overlapped): loss and every gradient."""
    stock.load_state_dict(overlap.state_dict())
    loss, grads = _step(overlap)
    ref_loss, ref_grads = _step(stock)
    return dict(loss=_rel(loss, ref_loss), names=sorted(grads) == sorted(ref_grads),
                grads=max(_rel(grads[k], ref_grads[k]) for k in ref_grads))


def _launch(line, path="builder"):
    """Parse + build the overlapped and stock models of `line`; what they are and did."""
    import warnings

    args = _parse(SMALL + LINES[line] + SPEC + OVERLAP + ["--standin-flag", "3"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _build(args, path)
        layers = _moe_layers(model)
        stock = _build(_parse(SMALL + LINES[line] + SPEC), path)
        res = _compare(model, stock)
    res.update(
        standin=args.standin_flag, bias=args.add_bias_linear, impl=args.transformer_impl,
        layers=[(type(m).__name__, type(m.experts).__name__) for m in layers],
        stock=[(type(m).__name__, type(m.experts).__name__) for m in _moe_layers(stock)],
        fused=[m.last_rows is not None for m in layers],
        fc2_bias=[hasattr(m.experts.linear_fc2, "bias0") for m in layers
                  if hasattr(m.experts, "linear_fc2")],
        fallback=[str(w.message) for w in caught if "megatron-overlap" in str(w.message)])
    return res


def _launch_scenarios(rank, world):
    import mcore_shims

    mcore_shims.install()
    mcore_shims.install_megatron_training()
    res = {"local": _launch("local"), "local_gpt_builder": _launch("local", "gpt_builder")}

    # Megatron's own local spec for the same line (no --spec): SequentialMLP experts, which
    # GroupedGemmExperts replaces with the same initial weights. (Forward only: with expert
    # biases Megatron's SequentialMLP backward fails on its own in-place bias add, 0.19.2.)
    ours = _build(_parse(SMALL + LINES["local"] + SPEC), "gpt_builder")
    megatron = _build(_parse(SMALL + LINES["local"]), "gpt_builder_stock")
    with torch.no_grad():
        res["megatron_local"] = dict(
            experts=sorted({type(m.experts).__name__ for m in _moe_layers(megatron)}),
            loss=_rel(_step(ours, backward=False)[0], _step(megatron, backward=False)[0]))

    # The TE line where Megatron-Core has no TE: a clear error from our spec
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_overlap.mcore.spec import gpt_block_spec_from_args

    if gpt_layer_specs.TESpecProvider is None:
        args = _parse(SMALL + LINES["te"] + SPEC + OVERLAP)
        try:
            gpt_block_spec_from_args(args, core_transformer_config_from_args(args))
            res["no_te_error"] = None
        except RuntimeError as err:
            res["no_te_error"] = str(err)

    import megatron_te_double

    megatron_te_double.install()
    res["te"] = _launch("te")
    # Megatron-LM's defaults exactly (no --moe-grouped-gemm, bias-dropout fusion on):
    # SequentialMLP experts of (here: double) linears
    args = _parse([a for a in SMALL if a != "--moe-grouped-gemm"] + SPEC + OVERLAP)
    model = _build(args)
    res["te_defaults"] = [(type(m).__name__, type(m.experts).__name__)
                          for m in _moe_layers(model)]
    return res


@pytest.fixture(scope="module")
def launch():
    return run_ranks(1, _launch_scenarios)[0]


@pytest.mark.parametrize("line", ["local", "local_gpt_builder"])
def test_local_grouped_gemm_line_builds_overlap_layers_over_grouped_experts(launch, line):
    r = launch[line]
    assert r["impl"] == "local" and r["standin"] == 3  # the other provider's flag parsed too
    assert r["layers"] == [("OverlapMoELayer", "GroupedGemmExperts")] * 2, r
    assert r["stock"] == [("MoELayer", "GroupedGemmExperts")] * 2, r


@pytest.mark.parametrize("line", ["local", "local_gpt_builder", "te"])
def test_launched_model_fuses_every_moe_layer_without_a_fallback_warning(launch, line):
    r = launch[line]
    assert r["fallback"] == [] and all(r["fused"]) and len(r["fused"]) == 2, r


@pytest.mark.parametrize("line", ["local", "local_gpt_builder", "te"])
def test_launched_model_forward_backward_matches_stock_with_the_same_weights(launch, line):
    r = launch[line]
    assert r["names"] and r["loss"] < 1e-5 and r["grads"] < 1e-4, r


def test_our_stock_grouped_experts_draw_megatrons_sequential_mlp_weights(launch):
    r = launch["megatron_local"]
    assert r["experts"] == ["SequentialMLP"] and r["loss"] < 1e-5, r


def test_te_default_line_with_biases_builds_overlap_layers_over_te_grouped_mlp(launch):
    r = launch["te"]
    assert r["impl"] == "transformer_engine" and r["bias"] is True, r
    assert r["layers"] == [("OverlapMoELayer", "TEGroupedMLP")] * 2, r
    assert r["stock"] == [("MoELayer", "TEGroupedMLP")] * 2, r
    assert r["fc2_bias"] == [True, True]  # FC2's expert biases exist (and were fused)


def test_megatron_lm_default_flags_give_overlap_layers_over_sequential_experts(launch):
    assert launch["te_defaults"] == [("OverlapMoELayer", "SequentialMLP")] * 2


def test_te_spec_without_transformer_engine_is_a_clear_error(launch):
    if "no_te_error" not in launch:
        pytest.skip("Megatron-Core imports Transformer Engine here")
    err = launch["no_te_error"]
    assert err is not None and "needs Transformer Engine" in err
    assert "--transformer-impl local" in err


# ---------------------------------------------------------------- launcher (in process)
def test_provider_composes_with_another_and_adds_the_flags_once():
    import argparse

    from megatron_overlap.mcore import add_moe_overlap_args, moe_overlap_args_provider

    twice = moe_overlap_args_provider(moe_overlap_args_provider(_modelopt_standin))
    args = twice(argparse.ArgumentParser()).parse_args(["--moe-overlap", "--standin-flag", "2"])
    assert args.moe_overlap and args.standin_flag == 2
    assert moe_overlap_args_provider(add_moe_overlap_args)(argparse.ArgumentParser())
    with pytest.raises(ValueError, match="callable"):
        moe_overlap_args_provider("add_modelopt_args")


def _launch_worker(rank, world, script, out):
    import json

    import mcore_shims

    mcore_shims.install_megatron_training()
    from megatron_overlap.mcore import launch

    launch.main([script, "--num-layers", "3", "--moe-overlap", "--standin-flag", "5"])
    return json.loads(Path(out).read_text())


def test_launcher_runs_an_unmodified_script_with_the_overlap_flags(tmp_path):
    """The script calls Megatron's parse_args with its own provider, as pretrain_gpt.py
    does; the launcher adds ours; the script's sibling modules import."""
    (tmp_path / "sibling.py").write_text("def provider(parser):\n"
                                         "    parser.add_argument('--standin-flag', type=int)\n"
                                         "    return parser\n")
    out = tmp_path / "seen.json"
    script = tmp_path / "pretrain_like.py"
    script.write_text(
        "import json, sys\n"
        "from megatron.training.arguments import parse_args\n"
        "from sibling import provider\n"
        "if __name__ == '__main__':\n"
        "    a = parse_args(extra_args_provider=provider)\n"
        f"    open({str(out)!r}, 'w').write(json.dumps(dict(argv0=sys.argv[0], layers="
        "a.num_layers, overlap=a.moe_overlap, standin=a.standin_flag)))\n")
    seen = run_ranks(1, _launch_worker, str(script), str(out))[0]
    assert seen == dict(argv0=str(script), layers=3, overlap=True, standin=5)


# ---------------------------------------------------------------- recipes
def _recipe_argv(recipe, tp, ep, tmp_path, **extra_env):
    """What `TP=tp EP=ep bash recipe` hands torchrun (a stand-in that writes its argv)."""
    bin_dir, out = tmp_path / "bin", tmp_path / f"{recipe.stem}-{tp}-{ep}.argv"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "torchrun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "$TORCHRUN_ARGV"\n'
                    'env -0 > "$TORCHRUN_ARGV.env"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    megatron_lm = tmp_path / "Megatron-LM"
    megatron_lm.mkdir(exist_ok=True)
    for script in {"pretrain_gpt.py", *SCRIPTS.values()}:
        (megatron_lm / script).write_text("")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TORCHRUN_ARGV=str(out),
               TP=str(tp), EP=str(ep), MEGATRON_LM=str(megatron_lm))
    for key in ("DATA_PATH", "CHECKPOINT_PATH", "GPUS_PER_NODE", "NNODES", "SEQ", "NUM_LAYERS",
                "MOE_OVERLAP", "SCRIPT", "HYBRID_LAYER_PATTERN", "MOE_LAYER_FREQ"):
        env.pop(key, None)
    env.update(extra_env)
    done = subprocess.run(["bash", str(recipe)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    argv = out.read_bytes().decode().split("\0")[:-1]
    i = argv.index("-m")
    assert argv[i + 1] == "megatron_overlap.mcore.launch"
    assert argv[i + 2] == str(megatron_lm / SCRIPTS.get(recipe.stem, "pretrain_gpt.py"))
    torchrun = dict(zip(argv[:i:2], argv[1:i:2]))
    seen = dict(kv.split("=", 1) for kv in Path(f"{out}.env").read_bytes().decode().split("\0")
                if "=" in kv)
    exported = {k: v for k, v in seen.items() if env.get(k) != v and k not in ("_", "SHLVL")}
    return torchrun, argv[i + 3:], exported


def _recipe_worker(rank, world, lines):
    """Each recipe line through Megatron-LM's parser + validate_args with our provider: the
    TransformerConfig it gives and the OverlapConfig (preset resolved)."""
    import mcore_shims

    mcore_shims.install_megatron_training()
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        validate_args,
    )

    from megatron_overlap.mcore import moe_overlap_args_provider, overlap_config_from_args
    from megatron_overlap.planner.presets import get_preset

    found = []
    for world_size, argv, exported in lines:
        os.environ.update(exported, WORLD_SIZE=str(world_size), RANK="0")
        # (CPU: TransformerConfig checks that TE's fused RoPE imports; the recipes run on TE)
        sys.argv = ["pretrain_gpt.py", *argv, "--no-rope-fusion"]
        args = parse_args(extra_args_provider=moe_overlap_args_provider(None))
        validate_args(args)
        c = core_transformer_config_from_args(args)
        overlap = overlap_config_from_args(args)
        preset = None if overlap is None else overlap.preset
        if preset is not None:
            get_preset(preset)
        found.append(dict(
            spec=args.spec, impl=args.transformer_impl, overlap=overlap is not None,
            pattern=getattr(args, "hybrid_layer_pattern", None),
            dispatcher=c.moe_token_dispatcher_type, preset=preset,
            fields={k: getattr(c, k, None) for k in _RECIPE_FIELDS}))
    return found


_RECIPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "moe_ffn_hidden_size", "num_moe_experts",
                  "moe_router_topk", "moe_router_pre_softmax", "moe_shared_expert_intermediate_size",
                  "moe_shared_expert_gate", "moe_layer_freq", "moe_router_load_balancing_type",
                  "moe_aux_loss_coeff", "add_bias_linear", "add_qkv_bias", "gated_linear_unit",
                  "normalization", "layernorm_epsilon", "multi_latent_attention", "kv_lora_rank",
                  "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "moe_grouped_gemm",
                  "tensor_model_parallel_size", "expert_model_parallel_size",
                  "sequence_parallel", "qk_layernorm", "q_lora_rank")


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipes")
    cases, lines = [], []
    for recipe in RECIPES:
        for tp, ep in LAYOUTS:
            torchrun, argv, exported = _recipe_argv(recipe, tp, ep, tmp)
            assert torchrun["--nproc_per_node"] == str(tp * ep) and torchrun["--nnodes"] == "1"
            assert exported["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # Megatron asks it under TP
            assert exported["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"  # multicast stays off
            cases.append((recipe.stem, tp, ep))
            lines.append((tp * ep, argv, exported))
        cases.append((recipe.stem, "calibration"))  # the README's example: the h200 preset
        _, argv, exported = _recipe_argv(recipe, 1, 1, tmp)
        lines.append((1, argv + ["--moe-overlap-calibration", "h200"], exported))
        cases.append((recipe.stem, "depth 4"))  # one GPU's training-loop check
        _, argv, exported = _recipe_argv(recipe, 1, 1, tmp, NUM_LAYERS="4")
        lines.append((1, argv, exported))
        cases.append((recipe.stem, "stock"))
        _, argv, exported = _recipe_argv(recipe, 1, 1, tmp, MOE_OVERLAP="0")
        lines.append((1, argv, exported))
    return dict(zip(cases, run_ranks(1, _recipe_worker, lines)[0]))


def test_recipes_exist_for_every_model():
    assert [r.stem for r in RECIPES] == ["deepseek", "granite", "qwen", "qwen_hybrid"]


def test_every_recipe_line_parses_through_megatron_lm_with_the_flag_alone(recipe_runs):
    for case, r in recipe_runs.items():
        assert r["spec"] is None, case  # Megatron's own spec choice: no --spec needed
        assert r["impl"] == "transformer_engine", case
        assert r["overlap"] == (case[1] != "stock"), case
        assert r["dispatcher"] == "allgather", case


def test_recipe_depth_and_moe_layer_pattern_come_from_the_environment(recipe_runs):
    for model in ("granite", "qwen", "deepseek"):
        assert recipe_runs[(model, "depth 4")]["fields"]["num_layers"] == 4, model
    # DeepSeek-V2-Lite's dense first layer, then MoE, at any depth
    assert recipe_runs[("deepseek", "depth 4")]["fields"]["moe_layer_freq"] == [0, 1, 1, 1]
    assert recipe_runs[("qwen_hybrid", "depth 4")]["pattern"] == "*E" * 4


def test_recipe_calibration_example_names_a_shipped_preset(recipe_runs):
    for model in ("granite", "qwen", "deepseek", "qwen_hybrid"):
        assert recipe_runs[(model, "calibration")]["preset"] == "h200"


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"TP{tp}EP{ep}" for tp, ep in LAYOUTS])
def test_the_hybrid_recipe_is_qwen_with_attention_and_moe_as_layers_of_their_own(
        recipe_runs, layout):
    hybrid, gpt = recipe_runs[("qwen_hybrid", *layout)], recipe_runs[("qwen", *layout)]
    assert hybrid["pattern"] == "*E" * 24 and gpt["pattern"] is None
    assert hybrid["fields"]["num_layers"] == 48
    assert {k: v for k, v in hybrid["fields"].items() if k != "num_layers"} == {
        k: v for k, v in gpt["fields"].items() if k != "num_layers"}


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"TP{tp}EP{ep}" for tp, ep in LAYOUTS])
def test_recipe_models_are_the_models_py_configs(recipe_runs, layout):
    from megatron_overlap.mcore.models import model_config

    for model in ("granite", "qwen", "deepseek"):
        got = recipe_runs[(model, *layout)]["fields"]
        want, _ = model_config(model, *layout, impl="te")
        for key in _RECIPE_FIELDS:
            assert got[key] == getattr(want, key, None), (model, layout, key)
