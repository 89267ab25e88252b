"""The benchmark scripts run end to end in their CPU smoke modes and write the JSON they promise.

The numbers themselves count only on a GPU (``docs/performance.md``); these tests keep the scripts that
someone reruns on a GPU host from breaking unnoticed. Sizes are the smallest the scripts accept: the
tests check that every path runs and the JSON's shape, not speed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _bench_module(name: str):
    """Import ``benchmarks/<name>.py`` (a script directory, not a package)."""
    import importlib

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


SMOKE_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
"""The scripts' CPU mode on one intra-op thread: tiny models gain nothing from more, and a busy host's
spinning OpenMP threads would slow every step a hundredfold."""


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **SMOKE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.timeout(300)
def test_bench_stall_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "stall.json"
    with_env = "checkpointd@CHECKPOINTD_IO_THREADS=2+CHECKPOINTD_RECYCLE=0"
    proc = _run("bench_stall.py", "--cpu", "--tiny", "--methods", f"none,checkpointd,torch_save,lightning_async,checkpointd_lightning,io_only,copy_only,clone_only,{with_env},none",
                "--step-counters", "--dir", str(tmp_path / "ckd"), "--json", str(out))
    runs = {r["method"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs[with_env]["env"] == {"CHECKPOINTD_IO_THREADS": "2", "CHECKPOINTD_RECYCLE": "0"}
    assert "error" not in runs[with_env] and len(runs[with_env]["stall_ms"]) >= 3
    ckd = runs["checkpointd"]
    assert "error" not in ckd, ckd.get("error")
    assert len(ckd["stall_ms"]) >= 3 and len(ckd["stall_by_step_ms"]) == 4
    assert len(ckd["stall_local_ms"]) == len(ckd["stall_ms"]) and "local" in proc.stdout
    assert ckd["stats"]["saves_committed"] == len(ckd["saves"]) >= 3
    assert len(runs["torch_save"]["stall_ms"]) >= 3
    for m in ("checkpointd", "torch_save", "lightning_async", "checkpointd_lightning"):  # saved=step: what each wrote
        assert "error" not in runs[m] and len(runs[m]["stall_ms"]) >= 3, runs[m].get("error")
        assert runs[m]["values_at_save"]["equal"] is True, (m, runs[m]["values_at_save"])
    io_only = runs["io_only"]  # the persist process writing the same bytes, nothing else
    assert "error" not in io_only and "skipped" not in io_only, io_only.get("error") or io_only.get("skipped")
    assert len(io_only["stall_ms"]) >= 3 and len(io_only["persist_s"]) >= 2 and all(t > 0 for t in io_only["persist_s"])
    assert not [f for f in os.listdir(tmp_path / "ckd") if f.startswith("io")]  # the last files removed at the end
    assert "save/+1/+2/rest" in proc.stdout
    last = ckd["stats"]["last_save"]  # the write column: first and last saves' seconds and recycled files
    assert last["files"] >= 1 and 0 <= last["files_recycled"] <= last["files"]
    assert "write s 1st/last [recycled]" in proc.stdout and f"/{last['files']}]" in proc.stdout
    assert "CUDA" in runs["copy_only"]["skipped"]  # the device-to-host copy alone: GPU only, said so on CPU
    assert "CUDA" in runs["clone_only"]["skipped"]  # device staging's copies alone: likewise
    counters = ckd["step_counters"]  # --step-counters: one delta per step of each counter the kernel has
    assert {"pgfault", "proc_minflt", "proc_user_ms", "host_intr"} <= set(counters) and all(len(v) == len(ckd["step_s"]) for v in counters.values())
    assert sum(counters["proc_minflt"]) > 0  # the saves fault pages in


def test_slow_step_profile_sets_slow_steps_against_the_rest() -> None:
    common = _bench_module("common")
    steps = [0.010] * 9 + [0.030]  # one step 20 ms above the median
    deltas = {"wait_ms": [0.0] * 9 + [18.0], "pgfault": [2.0] * 10, "compact_stall": [0.0] * 10}
    prof = common.slow_step_profile(steps, deltas, over_ms=3.0)
    assert prof is not None and prof["slow_steps"] == 1 and prof["other_steps"] == 9
    assert prof["per_step"] == {"wait_ms": [18.0, 0.0], "pgfault": [2.0, 2.0]}  # counters that never moved are left out
    assert common.slow_step_profile([0.010] * 10, deltas) is None  # no slow step: nothing to compare
    now = common.StepCounters.read()
    assert "pgfault" in now and now["pgfault"] > 0  # Linux: /proc/vmstat


@pytest.mark.timeout(300)
def test_bench_persist_and_restore_cpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "persist.json"
    proc = _run("bench_persist.py", "--cpu", "--tiny", "--repeat", "1", "--rounds", "2", "--raw-threads", "1,2", "--dirs",
                str(tmp_path / "p"), "--methods", "raw,torch_save,checkpointd,checkpointd_device_planes_fast",
                "--settle-s", "0", "--json", str(out))
    data = json.loads(out.read_text())
    rows = [r for d in data["dirs"] for r in d.get("rows", []) if not r.get("skipped")]
    skipped = {r["method"]: r["skipped"] for d in data["dirs"] for r in d.get("rows", []) if r.get("skipped")}
    assert skipped == {"checkpointd_device_planes_fast": "device staging needs the state on a CUDA device (--state-on device)"}
    methods = {r["method"] for r in rows}
    assert {"checkpointd", "torch_save (+fsync)", "raw model + optim files x 1 thr each"} <= methods, methods
    for r in rows:  # every row timed once in each of the two interleaved rounds
        assert "error" not in r, r["error"]
        assert r["rounds"] == [0, 1] and len(r["times_s"]) == 2, (r["method"], r["rounds"])
    ckd = next(r for r in rows if r["method"] == "checkpointd")
    assert ckd["notes"] == ["CHECKPOINTD_RECYCLE=0"]  # the new-files row: no blank files made ahead
    assert ckd["stats"]["saves_committed"] == 3 and ckd["warmup_s"] > 0  # one manager: a warm-up, then a save a round
    assert "x raw/round" in proc.stdout
    if data["dirs"][0]["fs"] not in ("tmpfs", "ramfs"):  # a disk: raw rows with early writeback too
        assert {"raw 1 file x 2 thr (writeback)", "raw 2 files x 2 thr (writeback)"} <= methods, methods

    out = tmp_path / "restore.json"
    _run("bench_restore.py", "--cpu", "--tiny", "--repeat", "1", "--dirs", str(tmp_path / "r"), "--json", str(out))
    text = out.read_text()
    assert "checkpointd" in text and "torch_load" in text
    rows = {r["method"]: r for r in json.loads(text)["dirs"][0]["rows"]}
    phases = [rows[f"checkpointd phases: {p}"] for p in ("verified read", "apply", "read + apply")]
    for r in phases:
        assert "error" not in r and r["ok"] and len(r["times_s"]) == 1, r
    read, apply, both = (r["times_s"][0] for r in phases)
    assert both == pytest.approx(read + apply)
    cold = rows["checkpointd restore_latest, fresh process"]  # values checked by the parent
    assert "error" not in cold and cold["ok"] and len(cold["times_s"]) == 1 and cold["setup_s"][0] > 0, cold
    for m in ("checkpointd_hostverify restore_latest", "checkpointd_hostverify restore_latest, fresh process"):
        r = rows[m]  # the host checksum beside the default, in-process and in a fresh process (env passed on)
        assert "error" not in r and r["ok"] and "CHECKPOINTD_RESTORE_VERIFY=host" in r["notes"], r
    raw_cold = next(r for m, r in rows.items() if m.endswith("thr, fresh process"))  # crcs checked by the parent
    assert "error" not in raw_cold and raw_cold["ok"] and len(raw_cold["times_s"]) == 1, raw_cold
    if sys.platform == "linux":  # /proc/vmstat's counter read around each fresh read
        assert isinstance(raw_cold["activated"][0], int) and isinstance(cold["activated"][0], int)
    assert "x raw fresh process: first" in text


def test_bench_restore_table_puts_the_median_beside_the_best() -> None:
    """The best of a few repetitions hides a row's spread (a GPU-verified row's warm samples can be 220 and
    334 ms); the table prints each row's median and its ratio to the best raw row's median."""
    bench_restore = _bench_module("bench_restore")
    gb = 4.834

    def row(method: str, kind: str, times: list[float]) -> dict:
        return {"method": method, "kind": kind, "times_s": times, "ok": True, "GBps": gb / min(times)}

    res = {"info": {"device": "GPU", "torch": "x", "date": "d", "cpu_count": 16},
           "state": {"state_bytes": gb * 1e9, "tensors": 240, "D": 2048, "L": 8, "state_on": "cuda"},
           "args": {"settle_s": 3.0},
           "dirs": [{"dir": "/dev/shm/r", "fs": "tmpfs", "rows": [
               row("raw read x 8 thr", "raw", [0.20, 0.21, 0.22]),
               row("raw read x 16 thr", "raw", [0.13, 0.14, 0.15]),
               row("checkpointd restore_latest", "checkpointd", [0.52, 0.18, 0.28])]}]}
    lines = bench_restore.summarise(res).splitlines()
    header = next(line for line in lines if line.startswith("method"))
    cells = dict(zip(re.split(r"\s{2,}", header.strip()),
                     re.split(r"\s{2,}", next(line for line in lines if line.startswith("checkpointd")).strip())))
    assert cells["best s"] == "0.180" and cells["median s"] == "0.280" and cells["first s"] == "0.520"
    assert cells["x raw"] == "0.72" and cells[">=0.7x raw"] == "ok"  # best against the best raw row's best
    assert cells["x raw median"] == "0.50"  # 0.14 / 0.28: the median against the best raw row's median


@pytest.mark.timeout(300)
def test_bench_compression_small_smoke(tmp_path: Path) -> None:
    out = tmp_path / "compression.json"
    _run("bench_compression.py", "--mb", "8", "--repeat", "1", "--json", str(out))
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["info"]["planes_kernels"].startswith(("native (", "NumPy ("))  # the table says which ran
    assert result["info"]["date"] and "bench_compression.py" in result["info"]["command"]
    assert "zstd-planes kernels:" in result["table"] and result["complete"] is True
    planes = {r["input"]: r for r in rows if r["method"] == "zstd-planes"}
    plain = {r["input"]: r for r in rows if r["method"] == "zstd"}
    assert "randn*0.02 bf16" in planes and planes["randn*0.02 bf16"]["ratio"] > plain["randn*0.02 bf16"]["ratio"] > 1.0
    trained = "AdamW state, trained MLP fp32"  # moments from 200 real AdamW steps
    assert planes[trained]["ratio"] > plain[trained]["ratio"] > 1.0
    assert all(r["compress_gbps"] > 0 and r["decompress_gbps"] > 0 for r in rows)


@pytest.mark.timeout(300)
def test_bench_quantized_smoke(tmp_path: Path) -> None:
    """Every method on two quantized states; checkpointd's restores bit-exact, DCP's outcome recorded."""
    pytest.importorskip("torchao")
    out = tmp_path / "quantized.json"
    _run("bench_quantized.py", "--width", "256", "--layers", "1", "--kinds", "int8,qlora", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(r["state"], r["method"]) for r in rows} == {(k, m) for k in ("int8", "qlora") for m in (
        "checkpointd", "checkpointd_plain", "dcp_async", "dcp", "torch_save")}
    ours = [r for r in rows if r["method"] in ("checkpointd", "checkpointd_plain")]
    assert all(r["bit_exact"] is True and r["bytes"] > 0 and r["complete_s"] >= r["call_s"] for r in ours)
    assert {c for r in ours for c in r["classes"]} == {"Int8Tensor", "NF4Tensor"}
    assert all("bit_exact" in r or "error" in r for r in rows)


@pytest.mark.timeout(300)
def test_bench_s3_smoke(tmp_path: Path) -> None:
    """Against a real SeaweedFS server: every codec stores fewer bytes than none, and auto picks planes."""
    out = tmp_path / "s3.json"
    _run("bench_s3.py", "--mb", "2", "--saves", "1", "--links", "0,20", "--json", str(out))
    doc = json.loads(out.read_text())
    result = doc["rows"]
    assert "bench_s3.py" in doc["info"]["command"] and doc["info"]["cpu_count"] >= 1  # what performance.md quotes
    for link in (0, 20):
        rows = {str(r["compression"]): r for r in result if r["link_mb_per_s"] == link}
        assert 0.95 < rows["None"]["ratio"] <= 1.0  # manifest and markers beside the native files
        assert rows["zstd-planes"]["ratio"] > rows["zstd"]["ratio"] > 1.0
        assert rows["auto"]["codec"] == "zstd-planes"
    throttled = next(r for r in result if r["link_mb_per_s"] == 20 and r["compression"] is None)
    assert min(throttled["commit_s"]) >= 0.9 * throttled["bytes"] / 20e6  # the proxy holds the link to 20 MB/s


@pytest.mark.timeout(300)
def test_bench_float8_fsdp_smoke(tmp_path: Path) -> None:
    """torchao float8 training under FSDP2 on 2 gloo ranks: checkpointd's rows restore bit-exactly."""
    pytest.importorskip("torchao")
    out = tmp_path / "float8_fsdp.json"
    env = dict(os.environ, **SMOKE_ENV, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(BENCH / "bench_float8_fsdp.py"),
                           "--cpu", "--width", "64", "--layers", "2", "--batch", "16", "--steps", "4", "--after", "2",
                           "--dir", str(tmp_path / "ckpt"), "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"checkpointd", "checkpointd_device", "dcp_async", "dcp"}
    for name in ("checkpointd", "checkpointd_device"):
        assert rows[name]["bit_exact"] is True and rows[name]["bytes"] > 0, rows[name]
        assert rows[name]["classes"] == ["Tensor", "WeightWithDynamicFloat8CastTensor"]
    assert all(isinstance(r.get("bit_exact"), bool) or "error" in r for r in rows.values())


def _drift_runs(medians: dict[str, float], base: float) -> list[dict]:
    return [{"method": m, "median_step_ms": v, "none_median_step_ms": base} for m, v in medians.items()]


def test_bench_stall_warns_when_the_loops_step_time_drifts() -> None:
    bench_stall = _bench_module("bench_stall")
    # steady loop; a checkpointing method slower than the baseline is a cost, not drift
    assert bench_stall.drift_warning(_drift_runs({"none": 10.0, "checkpointd": 10.6, "none#2": 10.1}, 10.05)) is None
    # a method faster than the baseline: the loop itself sped up
    faster = bench_stall.drift_warning(_drift_runs({"none": 10.0, "copy_only": 7.0, "none#2": 10.1}, 10.05))
    assert faster is not None and "copy_only 7.00" in faster and "none#2" not in faster
    assert "up to 64 ms" in faster  # 21 steps x 3.05 ms
    # the two placebo runs disagree
    nones = bench_stall.drift_warning(_drift_runs({"none": 9.99, "checkpointd": 9.5, "none#2": 8.48}, 9.39))
    assert nones is not None and "none 9.99" in nones and "none#2 8.48" in nones
    assert bench_stall.drift_warning([{"method": "none"}]) is None  # nothing measured: nothing to say


def test_bench_stall_names_long_steps_outside_every_stall_window() -> None:
    """A cost paid outside the save step and the 20 after it is in no stall number: named under the table
    (e.g. staging buffers page-locked on the training thread at step 2)."""
    bench_stall = _bench_module("bench_stall")
    every, steps = 30, 89
    base = [0.010] * steps
    blocked = list(base)
    blocked[0] = 0.050  # every run's first step is slow: never named
    blocked[1] = 2.0  # step 2: outside every window
    blocked[30] = 0.500  # step 31, inside the first save's window: the stall counts it
    runs = [{"method": "none", "step_s": list(base), "saves": []},
            {"method": "checkpointd", "step_s": blocked, "saves": [30, 60]},
            {"method": "checkpointd_device", "step_s": list(base), "saves": [30, 60]}]
    runs[2]["step_s"][0] = 0.080
    bench_stall.analyse(runs, every, steps)
    assert runs[1]["longest_outside_step"] == 2 and abs(runs[1]["longest_outside_ms"] - 1990.0) < 1e-6
    assert runs[1]["stall_ms"][0] > 480  # the slow step in the window is in the stall, not in the note
    note = bench_stall.outside_warning(runs)
    assert note is not None and "checkpointd 1990.0 ms above the median at step 2" in note
    assert "checkpointd_device" not in note and "none" not in note


def test_bench_stall_sums_a_spread_cost_before_the_first_save() -> None:
    """Steps a little slower each (the arena page-locked in pieces: +10 ms over ten steps) pass under the
    50 ms note but show in ``before_first_save_ms``; a run without them shows none."""
    bench_stall = _bench_module("bench_stall")
    every, steps = 30, 89
    base = [0.010] * steps
    spread = list(base)
    for j in range(5, 15):
        spread[j] += 0.010
    spread[29] += 0.5  # the save step itself: in the stall, not before the first save
    runs = [{"method": "none", "step_s": list(base), "saves": []},
            {"method": "checkpointd", "step_s": spread, "saves": [30, 60]},
            {"method": "checkpointd_device", "step_s": list(base), "saves": [30, 60]}]
    for r in runs[1:]:
        r["block_s"] = [0.003, 0.003]
    bench_stall.analyse(runs, every, steps)
    assert abs(runs[1]["before_first_save_ms"] - 100.0) < 1e-6
    assert abs(runs[2]["before_first_save_ms"]) < 1e-6
    assert bench_stall.outside_warning(runs) is None, "no single step is 50 ms slower"
    assert "pre ms" in bench_stall.summarise({"runs": runs, "info": {"device": "cpu", "torch": "x", "date": "d"},
                                              "workload": {"D": 1, "L": 1, "B": 1, "S": 1, "params": 1, "state_bytes": 1,
                                                           "tensors": 1, "ckpts": 2, "every": every, "steps": steps,
                                                           "dir": "d", "dir_fs": "tmpfs"}})


def test_interleaved_runs_score_each_window_against_the_none_runs_beside_it() -> None:
    """A loop whose step time climbs 10 -> 14 ms over five interleaved runs, each checkpoint costing 30 ms
    in one step: the pooled baseline gives 9 and 51 ms (drift); the runs' neighbours give 30 every time,
    and the `none` runs scored the same way (the placebo) average 0."""
    bench_stall = _bench_module("bench_stall")
    every, steps = 30, 89
    levels = {"none": 0.010, "checkpointd": 0.011, "none#2": 0.012, "checkpointd#2": 0.013, "none#3": 0.014}
    runs = []
    for m, level in levels.items():
        st = [level] * steps
        saves = [] if m.startswith("none") else [30, 60]
        for s in saves:
            st[s] += 0.030
        runs.append({"method": m, "step_s": st, "saves": saves, "block_s": [0.001] * len(saves)})
    bench_stall.analyse(runs, every, steps)
    by = {r["method"]: r for r in runs}
    assert [round(x, 6) for x in by["checkpointd"]["stall_ms"]] == [9.0, 9.0]  # against the pooled median, 12 ms
    assert [round(x, 6) for x in by["checkpointd#2"]["stall_ms"]] == [51.0, 51.0]
    assert [round(x, 6) for x in by["checkpointd"]["stall_adjacent_ms"]] == [30.0, 30.0]
    assert [round(x, 6) for x in by["checkpointd#2"]["stall_adjacent_ms"]] == [30.0, 30.0]
    assert [round(x, 6) for x in by["none"]["placebo_adjacent_ms"]] == [-42.0, -42.0]  # against none#2 alone
    assert [round(x, 6) for x in by["none#2"]["placebo_adjacent_ms"]] == [0.0, 0.0]
    rows = {r["method"]: r for r in bench_stall.interleaved_summary(runs)}
    ckd = rows["checkpointd"]
    assert ckd["runs"] == 2 and ckd["n"] == 4 and abs(ckd["mean_ms"] - 30.0) < 1e-6 and abs(ckd["ci95_ms"]) < 1e-6
    assert rows["none"]["placebo"] and rows["none"]["n"] == 6 and abs(rows["none"]["mean_ms"]) < 1e-6
    assert rows["none"]["ci95_ms"] > 10  # -42, 0, +42 twice each: the placebo's spread shows
    text = bench_stall.summarise({"runs": runs, "info": {"device": "cpu", "torch": "x", "date": "d"},
                                  "workload": {"D": 1, "L": 1, "B": 1, "S": 1, "params": 1, "state_bytes": 1, "tensors": 1,
                                               "ckpts": 2, "every": every, "steps": steps, "dir": "d", "dir_fs": "tmpfs"}})
    assert "interleaved:" in text and "checkpointd              30.0 +- 0.0 ms" in text
    assert bench_stall.interleaved_summary(runs[:3]) == []  # none,checkpointd,none: nothing repeated, the table says it all
    once = {r["method"]: r for r in bench_stall.window_summary(runs[:3])}  # what perf_doc quotes for such a run
    assert once["checkpointd"]["runs"] == 1 and once["checkpointd"]["n"] == 2 and abs(once["checkpointd"]["mean_ms"] - 30.0) < 1e-6
    mean, half = bench_stall.mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and abs(half - 4.30 * 1.0 / 3 ** 0.5) < 1e-9


def test_bench_stall_dist_warns_per_rank_when_the_loop_drifts() -> None:
    bench_stall_dist = _bench_module("bench_stall_dist")
    steady = _drift_runs({"none": 50.0, "checkpointd": 51.0, "none#2": 50.5}, 50.2)
    drifting = _drift_runs({"none": 44.3, "checkpointd": 48.1, "none#2": 45.9}, 44.8)  # an FSDP2 rank's drift
    res = {"ranks": [{"rank": 0, "runs": drifting}, {"rank": 1, "runs": steady}]}
    warnings = bench_stall_dist.drift_warnings(res)
    assert len(warnings) == 1 and warnings[0].startswith("rank 0: WARNING") and "none#2 45.90" in warnings[0]
    assert bench_stall_dist.drift_warnings({"ranks": [{"rank": 0, "runs": steady}]}) == []


@pytest.mark.timeout(300)
def test_run_gpu_sh_runs_the_stages_asked_for(tmp_path: Path) -> None:
    """``STAGES`` splits the one-command run (e.g. over several shorter leases sharing one ``OUT``)."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), TMPFS_DIR=str(tmp_path / "t"), DISK_DIR=str(tmp_path / "d"),
               STAGES="restore_tmpfs", BENCH_ARGS="--cpu --tiny", **SMOKE_ENV, WHEELS=str(tmp_path / "none"),
               PYTHON=sys.executable, RESTORE_METHODS="raw,checkpointd,checkpointd_cold_python", RESTORE_REPEAT="1")
    proc = subprocess.run(["bash", str(BENCH / "run_gpu.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for skipped in ("stall", "persist_tmpfs", "compression", "persist_disk", "restore_disk", "stall_1gpu_half", "stall_dist"):
        assert f"== {skipped}: not in STAGES" in proc.stdout
    restored = json.loads((tmp_path / "out" / "restore_tmpfs.json").read_text())
    rows = {r["method"]: r for r in restored["dirs"][0]["rows"]}
    assert restored["complete"] and rows["checkpointd restore_latest"]["ok"]
    python = rows["checkpointd_python restore_latest, fresh process"]  # without native code, in a fresh process
    assert "error" not in python and python["ok"] and python["notes"][0] == "CHECKPOINTD_NATIVE=0", python
    assert sorted(p.name for p in (tmp_path / "out").glob("*.json")) == ["restore_tmpfs.json"]
    assert "checkpointd restore_latest" in proc.stdout  # the summary table
    bad = subprocess.run(["bash", str(BENCH / "run_gpu.sh")], cwd=tmp_path, env=dict(env, STAGES="stall,restore"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown stage 'restore'" in bad.stderr


@pytest.mark.timeout(240)
def test_run_gpu_sh_runs_the_two_gpu_comparison_as_one_stage(tmp_path: Path) -> None:
    """Stage ``stall_dist``: one GPU with half the state, then two ranks under torchrun against it (here on
    gloo, ``--cpu``): FSDP2, a sharded checkpointd manager (in-process writes too), DCP and the persist
    process driven directly, all interleaved; on a host with fewer than two GPUs it says so and runs nothing."""
    methods = "none,checkpointd,checkpointd_threads,dcp_async,none,checkpointd,io_only_reuse,none"
    env = dict(os.environ, OUT=str(tmp_path / "out"), TMPFS_DIR=str(tmp_path / "t"), DISK_DIR=str(tmp_path / "d"),
               STAGES="stall_dist", BENCH_ARGS="--cpu --tiny", **SMOKE_ENV, WHEELS=str(tmp_path / "none"),
               PYTHON=sys.executable, DIST_EVERY="22", DIST_CKPTS="3", DIST_METHODS=methods, STEP_COUNTERS="1",
               DIST_TIMEOUT_S="60")
    proc = subprocess.run(["bash", str(BENCH / "run_gpu.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref = json.loads((tmp_path / "out" / "stall_1gpu_half.json").read_text())
    data = json.loads((tmp_path / "out" / "stall_dist.json").read_text())
    assert ref["complete"] and data["complete"] and data["workload"]["world_size"] == 2
    assert data["ref_path"] == str(tmp_path / "out" / "stall_1gpu_half.json") and data["ref"]["runs"]
    assert [r["runs"] for r in ref["interleaved"] if r["method"] == "checkpointd"] == [2]
    per_rank = data["stall_by_rank"]["checkpointd"]
    assert [x["rank"] for x in per_rank] == [0, 1]
    assert all(len(x["stall_ms"]) == 3 and x["min"] <= x["mean"] <= x["max"] for x in per_rank)
    assert [x["rank"] for x in data["stall_by_rank"]["dcp_async"]] == [0, 1]
    for rk in data["ranks"]:
        for method in ("checkpointd", "checkpointd_threads"):
            ckd = next(r for r in rk["runs"] if r["method"] == method)
            assert "error" not in ckd, ckd.get("error")
            assert ckd["stats"]["saves_committed"] == 3
            assert len(ckd["step_counters"]["pgfault"]) == len(ckd["step_s"])  # STEP_COUNTERS on every rank
        # io_only_reuse drives the persist process directly; run last of its users, the process's exit must
        # not abort the ranks (bench_stall_dist.main shuts the persist process down)
        io = next(r for r in rk["runs"] if r["method"] == "io_only_reuse")
        assert "error" not in io and len(io["persist_s"]) == 3, io.get("error")
    for rank, rows in enumerate(data["interleaved_by_rank"]):  # checkpointd ran twice between `none` runs
        ckd = next(r for r in rows if r["method"] == "checkpointd")
        assert ckd["runs"] == 2 and ckd["n"] == 6 and ckd["ci95_ms"] >= 0
        assert f"interleaved, rank {rank}:" in proc.stdout
    assert "stall ms mean [min, max]" in proc.stdout
    assert "interleaved, 1gpu (half the state)" in proc.stdout  # the summary prints the two-GPU table
    none = subprocess.run(["bash", str(BENCH / "run_gpu.sh")], cwd=tmp_path, env=dict(env, BENCH_ARGS="", OUT=str(tmp_path / "o2")),
                          capture_output=True, text=True, timeout=120)
    assert none.returncode == 0 and "== stall_dist: skipped, needs 2 GPUs (found 0)" in none.stdout
    assert not list((tmp_path / "o2").glob("*.json"))


def test_perf_doc_writes_one_table_per_benchmark_from_the_kept_results(tmp_path: Path) -> None:
    """``perf_doc.py`` over the JSON kept in ``benchmarks/results/``: each benchmark's table names the
    workload, card, commit and command, with checkpointd beside torch.save and async_save."""
    out = tmp_path / "performance.md"
    proc = subprocess.run([sys.executable, str(BENCH / "perf_doc.py"), "--out", str(out),
                           f"H200={BENCH / 'results' / 'h200-stall'}@abc1234",
                           f"H200={BENCH / 'results' / 'h200-restore'}@def5678",
                           f"2x H200={BENCH / 'results' / 'h200x2-quantized'}@0123abc"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.count("\n## ") == 4 and "Command: `" in text and text.count("Commit: `0123abc`") == 2
    assert "`benchmarks/bench_float8_fsdp.py`" in text and "checkpointd_plain" in text
    assert text.count("Commit: `abc1234`") == 1 and text.count("Commit: `def5678`") == 1
    for row in ("`checkpointd`", "`dcp_async`", "`torch_save`", "`checkpointd restore_latest`", "`torch_load + load_state_dict`"):
        assert f"| {row} |" in text, row
