"""tools/device_run.sh, the device machine's runner: its header lists exactly the stages it
runs, the docs name only those, and the merged stages expand to the commands (and the file
names the report tools read) of the stages they replace, run here with stubs in place of
the GPU, Python and torchrun."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "device_run.sh"
sys.path.insert(0, str(ROOT / "tools"))

import report_grid  # noqa: E402


def header_stages() -> list[str]:
    """The stages the header comment lists (a name at two spaces' indent)."""
    head = SCRIPT.read_text().split("\nset -u\n")[0]
    return re.findall(r"^#   ([a-z_0-9]+)\s", head, re.M)


def case_stages() -> list[str]:
    """The stages the script's `case` runs (its arms at four spaces' indent)."""
    return re.findall(r"^    ([a-z_0-9]+)\)", SCRIPT.read_text(), re.M)


def test_the_script_parses_and_its_header_lists_exactly_its_stages():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert header_stages() == case_stages()
    assert len(case_stages()) <= 16, "the stages a user of the tools needs, about 15"


def test_the_docs_name_only_stages_the_script_has():
    """`device_run.sh [te] STAGE` and "stage `STAGE`" in the README, docs and tools."""
    stages = set(case_stages())
    named = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / "tools").glob("*.py")), ROOT / "tools" / "te_wheels.sh"]:
        text = path.read_text()
        for words in re.findall(r"device_run\.sh((?:[ \t]+[a-z_0-9]+)+)", text):
            for word in words.split():
                if word != "stage":  # ("device_run.sh stage te")
                    named.setdefault(word, set()).add(path.name)
        for word in re.findall(r"\bstage\s+`([a-z_0-9]+)`", text):
            named.setdefault(word, set()).add(path.name)
    assert {"grid", "layers", "prefill", "calibrate"} <= set(named)
    unknown = {w: sorted(f) for w, f in named.items() if w not in stages}
    assert not unknown, f"stages the docs name that tools/device_run.sh does not run: {unknown}"


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def dry_run(tmp_path: Path, stages: str, **env) -> list[str]:
    """The commands `device_run.sh STAGES` runs on a one-GPU machine, each as one line
    (the repository as R, the output folder as O), nothing installed or copied."""
    bin_, out = tmp_path / "bin", tmp_path / "out"
    bin_.mkdir(parents=True)
    log = tmp_path / "commands.txt"
    _stub(bin_, "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    for name in ("python3", "torchrun", "cp"):
        _stub(bin_, name, '[ "$1 $2" = "-m pip" ] && exit 0\necho "' + name
              + ' $*" >> "$STUB_LOG"\n')
    run = subprocess.run(["bash", str(SCRIPT), *stages.split()], capture_output=True,
                         text=True, timeout=60,
                         env=dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}",
                                  OUT=str(out), STUB_LOG=str(log), CAL_NAME="h100", **env))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.replace(str(ROOT), "R").replace(str(out), "O") for line in lines
            if not line.startswith("cp ")]


def _json(line: str) -> str:
    return re.search(r"--json O/(\S+)", line).group(1)


def test_gpu_tests_run_the_files_asked_for(tmp_path):
    default, = dry_run(tmp_path / "a", "gpu_tests")
    assert default.endswith("-rs R/tests/test_kernels_gpu.py R/tests/test_op_gpu.py "
                            "R/tests/test_mcore_gpu.py")
    asked, = dry_run(tmp_path / "b", "gpu_tests",
                     GPU_TEST_FILES="tests/test_mcore_te_gpu.py test_hf_checkpoint.py")
    assert asked.startswith("python3 -m pytest -q -m gpu")
    assert asked.endswith("-rs R/tests/test_mcore_te_gpu.py R/tests/test_hf_checkpoint.py")


def test_the_grid_stage_runs_the_core_te_grid_and_with_grid_fused_its_fused_flags(tmp_path):
    grid = dry_run(tmp_path / "a", "grid", TAG="h100_")
    assert len(grid) == 2 * 3 * 2  # prefill, train x three models x B = 1, 4
    assert all("-m megatron_overlap.mcore.prefill --impl te" in c and "--baselines" not in c
               for c in grid)
    names = [_json(c) for c in grid]
    assert "grid_h100_prefill_qwen_B4.json" in names and "grid_h100_train_granite_B1.json" in names
    assert all(report_grid.NAME.search(n) for n in names)
    fused = dry_run(tmp_path / "b", "grid", GRID_FUSED="1", TAG="h100_")
    assert len(fused) == 2 * 3  # B = 4 only
    assert all("--baselines default,fused" in c and "--batch 4" in c for c in fused)
    train = [c for c in fused if " --train" in c]
    assert len(train) == 3 and all("--layers 4" in c and "--seqs 4096 " in c for c in train)
    assert {_json(c) for c in fused} >= {"gridfused_h100_prefill_deepseek_B4.json",
                                        "gridfused_h100_train_qwen_B4.json"}


def test_the_layer_and_prefill_stages_take_te_and_the_training_step_as_options(tmp_path):
    layer, = dry_run(tmp_path / "a", "layers", LAYER_IMPLS="te,local", TAG="h100_fused_")
    assert "--impls te,local" in layer and _json(layer) == "layer_h100_fused_te_TP1EP1.json"
    plain, = dry_run(tmp_path / "b", "layers")
    assert "--impls local" in plain and _json(plain) == "layer_TP1EP1.json"
    runs = dry_run(tmp_path / "c", "prefill", PREFILL_IMPL="te", PREFILL_MODES="prefill train",
                   PREFILL_MODELS="qwen", TAG="h200_core_")
    assert [_json(c) for c in runs] == ["prefill_h200_core_te_qwen_TP1EP1.json",
                                        "train_h200_core_te_qwen_TP1EP1.json"]
    assert all("--impl te" in c for c in runs) and " --train" in runs[1]


def test_tune_and_calibrate_take_their_former_follow_up_stages_as_options(tmp_path):
    tune, cal = dry_run(tmp_path / "a", "tune calibrate", TUNE_COMM="1")
    assert "--comm-only" in tune and "tools/calibrate.py --name h100" in cal
    assert "--comm-only" not in dry_run(tmp_path / "b", "tune")[0]


def test_a_run_cut_at_its_bound_still_archives_what_its_finished_stages_wrote(tmp_path):
    """The device call's `timeout` sends TERM mid-stage: the JSON a finished stage wrote
    comes back in the archive (the tool returns 8 files at most), the running stage ends."""
    bin_, out = tmp_path / "bin", tmp_path / "out"
    bin_.mkdir()
    out.mkdir()
    _stub(bin_, "nvidia-smi", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    _stub(bin_, "cp", "exit 0\n")
    # the first bench_op writes its JSON, the second hangs until killed
    _stub(bin_, "python3", '[ "$1 $2" = "-m pip" ] && exit 0\nexit 0\n')
    _stub(bin_, "torchrun", 'for a in "$@"; do [ "$prev" = --json ] && f=$a; prev=$a; done\n'
          'if [ -e "$OUT/first.done" ]; then sleep 60; fi\n'
          'echo "{}" > "$f"; touch "$OUT/first.done"\n')
    proc = subprocess.Popen(["bash", str(SCRIPT), "bench_op", "bench_op"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}",
                                     OUT=str(out), CAL_NAME="h100", TAG="a_"))
    try:
        for _ in range(1200):  # the second stage is running once the first one's file exists
            if (out / "first.done").exists():
                break
            subprocess.run(["sleep", "0.05"])
        subprocess.run(["sleep", "0.5"])
        proc.terminate()
        proc.wait(timeout=20)
    finally:
        proc.kill()
    archives = list(out.glob("results_*.tgz"))
    assert len(archives) == 1 and proc.returncode == 143
    listed = subprocess.run(["tar", "tzf", str(archives[0])], capture_output=True, text=True,
                            check=True).stdout.split()
    assert "./op_a_TP1EP1.json" in listed
