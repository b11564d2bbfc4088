"""Configuration is explicit (issue 30, item 2): OverlapConfig() never depends on the
environment; `OverlapConfig.from_env` is the one reader of the MEGATRON_OVERLAP_*
variables, and every bad value raises ValueError naming its variable."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from megatron_overlap import env
from megatron_overlap.ops import OverlapConfig
from megatron_overlap.ops import config as config_module

#: a value of every variable from_env reads, none the default, and the field it sets
GOOD = {
    "MEGATRON_OVERLAP_PLACEMENT": ("partition", "placement", "partition"),
    "MEGATRON_OVERLAP_TAIL_HELPERS": ("0", "tail_helpers", False),
    "MEGATRON_OVERLAP_WAIT_TIMEOUT_S": ("2.5", "wait_timeout_s", 2.5),
    "MEGATRON_OVERLAP_MAX_SPINS": ("123", "max_spins", 123),
}
BAD = [
    ("MEGATRON_OVERLAP_MAX_SPINS", "abc"), ("MEGATRON_OVERLAP_MAX_SPINS", "0"),
    ("MEGATRON_OVERLAP_MAX_SPINS", "1e30"), ("MEGATRON_OVERLAP_MAX_SPINS", str(1 << 40)),
    ("MEGATRON_OVERLAP_TAIL_HELPERS", "maybe"), ("MEGATRON_OVERLAP_PLACEMENT", "inline"),
    ("MEGATRON_OVERLAP_WAIT_TIMEOUT_S", "soon"), ("MEGATRON_OVERLAP_WAIT_TIMEOUT_S", "0"),
    ("MEGATRON_OVERLAP_WAIT_TIMEOUT_S", "nan"), ("MEGATRON_OVERLAP_TILES", "/no/such.json"),
]


@pytest.fixture(autouse=True)
def _no_variables(monkeypatch):
    """Each test starts from an environment without MEGATRON_OVERLAP_* variables."""
    for name in list(os.environ):
        if name.startswith(env.PREFIX):
            monkeypatch.delenv(name)


def _tiles_file(tmp_path):
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"best": {"gemm": [64, 128, 64, 4, 3, False],
                                         "comm": [64, 1024, 32, True, 1, True]}}))
    config_module.load_tiles.cache_clear()
    return path


def _set_all(monkeypatch, tmp_path):
    for name, (value, _, _) in GOOD.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MEGATRON_OVERLAP_TILES", str(_tiles_file(tmp_path)))


def test_the_variables_set_or_not_an_overlap_config_is_the_same(monkeypatch, tmp_path):
    """Every variable set (and the removed ones): OverlapConfig() and a config of the
    interpreter's device are exactly what they are with none set."""
    plain = (OverlapConfig(), OverlapConfig(backend="interpret", splits=2),
             config_module.device_spec(torch.device("cpu"), 0))
    _set_all(monkeypatch, tmp_path)
    for name in env.REMOVED:
        monkeypatch.setenv(name, "7")
    assert (OverlapConfig(), OverlapConfig(backend="interpret", splits=2),
            config_module.device_spec(torch.device("cpu"), 0)) == plain
    with pytest.warns(RuntimeWarning, match="MEGATRON_OVERLAP_INTERPRET_SMS is not read"):
        assert OverlapConfig() != OverlapConfig.from_env()  # (the variables say something)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_from_env_reads_each_variable_into_its_field(monkeypatch, name):
    value, field, expected = GOOD[name]
    monkeypatch.setenv(name, value)
    config = OverlapConfig.from_env()
    assert getattr(config, field) == expected
    others = {f: getattr(OverlapConfig(), f) for f in env.VARIABLES.values() if f != field}
    assert {f: getattr(config, f) for f in others} == others


def test_from_env_reads_the_tiles_file_in_the_placement_asked_for(monkeypatch, tmp_path):
    path = _tiles_file(tmp_path)
    monkeypatch.setenv("MEGATRON_OVERLAP_TILES", str(path))
    tiles = OverlapConfig.from_env().tiles
    assert tiles == config_module.load_tiles(str(path))
    assert (tiles.block_m, tiles.comm_rows, tiles.placement) == (64, 64, "partition")
    assert OverlapConfig.from_env(placement="shared").tiles.placement == "shared"
    monkeypatch.setenv("MEGATRON_OVERLAP_PLACEMENT", "shared")
    assert OverlapConfig.from_env().tiles == config_module.in_placement(tiles, "shared")
    assert OverlapConfig.from_env(tiles=None).tiles is None  # an override wins


@pytest.mark.parametrize("value,expected", [("false", False), ("0", False), ("off", False),
                                            ("No", False), ("true", True), ("1", True),
                                            ("yes", True), ("ON", True), ("", True)])
def test_boolean_variables_take_the_usual_spellings(monkeypatch, value, expected):
    monkeypatch.setenv("MEGATRON_OVERLAP_TAIL_HELPERS", value)
    assert OverlapConfig.from_env().tail_helpers is expected


@pytest.mark.parametrize("name,value", BAD)
def test_a_bad_value_raises_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    OverlapConfig()  # (never read there)
    with pytest.raises(ValueError, match=f"environment variable {name}="):
        OverlapConfig.from_env()


def test_an_override_wins_and_its_variable_is_not_read(monkeypatch, tmp_path):
    _set_all(monkeypatch, tmp_path)
    monkeypatch.setenv("MEGATRON_OVERLAP_MAX_SPINS", "abc")
    config = OverlapConfig.from_env(max_spins=7, tail_helpers=True, backend="reference")
    assert (config.max_spins, config.tail_helpers, config.backend) == (7, True, "reference")
    assert config.wait_timeout_s == 2.5  # the others still come from theirs
    with pytest.raises(ValueError, match="OverlapConfig.max_spins"):
        OverlapConfig.from_env(max_spins=0)  # overrides are checked as in OverlapConfig()


def test_a_removed_or_unknown_variable_draws_a_warning_naming_it(monkeypatch):
    monkeypatch.setenv("MEGATRON_OVERLAP_FAST_LAUNCH", "0")
    monkeypatch.setenv("MEGATRON_OVERLAP_TAIL_HELPER", "0")  # (a misspelling)
    with pytest.warns(RuntimeWarning) as record:
        assert OverlapConfig.from_env() == OverlapConfig()
    text = " ".join(str(w.message) for w in record)
    assert "MEGATRON_OVERLAP_FAST_LAUNCH is not read: cached-binary" in text
    assert "MEGATRON_OVERLAP_TAIL_HELPER is not read" in text
    monkeypatch.delenv("MEGATRON_OVERLAP_FAST_LAUNCH")
    monkeypatch.delenv("MEGATRON_OVERLAP_TAIL_HELPER")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OverlapConfig.from_env()


def test_a_bad_variable_leaves_the_import_and_the_plain_config_working():
    """Read by from_env only, never at import: `import megatron_overlap.ops` and
    OverlapConfig() work whatever the variables hold; from_env names the variable."""
    code = ("import megatron_overlap.ops as o\n"
            "o.OverlapConfig()\n"
            "try:\n    o.OverlapConfig.from_env()\nexcept ValueError as e:\n    print(e)\n")
    environ = dict(os.environ, MEGATRON_OVERLAP_MAX_SPINS="abc",
                   TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=environ, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "MEGATRON_OVERLAP_MAX_SPINS='abc'" in out.stdout


def test_the_megatron_flags_build_their_config_from_env_with_the_flags_winning(monkeypatch):
    from megatron_overlap.mcore.args import overlap_config_from_args

    class Args:
        moe_overlap = True
        moe_overlap_no_tail_helpers = False
        moe_overlap_placement = "shared"

    monkeypatch.setenv("MEGATRON_OVERLAP_TAIL_HELPERS", "0")
    monkeypatch.setenv("MEGATRON_OVERLAP_PLACEMENT", "partition")
    config = overlap_config_from_args(Args())
    assert (config.tail_helpers, config.placement) == (False, "shared")


def test_a_tiles_file_naming_a_removed_switch_loads_as_one_without_it(tmp_path):
    """Tiles files written while TileConfig had the experiment switches measured as no
    gain (all off by default, removed since) still load: the switch is ignored, the
    tiles are the file's, and TileConfig no longer takes the field."""
    import dataclasses

    best = {"gemm": [128, 128, 64, 4, 3, False], "comm": [32, 512, 4, True, 1, True],
            "placement": "shared"}
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"best": best}))
    removed = ("comm_evict_first", "comm_dynamic_items", "gemm_places_from_marks",
               "gemm_tail_evict_last")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"best": {**best, **{name: True for name in removed}}}))
    config_module.load_tiles.cache_clear()
    assert config_module.load_tiles(str(old)) == config_module.load_tiles(str(plain))
    fields = {f.name for f in dataclasses.fields(config_module.TileConfig)}
    assert not fields & set(removed)
