#!/usr/bin/env bash
# One command for a CUDA host, from the repository root or anywhere:
#
#     bash benchmarks/run_gpu.sh
#
# Installs the carried wheels (if $WHEELS exists: zstandard, fsspec, zlib-ng, lightning), then runs, with PYTHONPATH=src:
#   1. bench_stall.py   (training stall; tmpfs target)            -> $OUT/stall.json
#   2. bench_persist.py (persist throughput; tmpfs, then disk)     -> $OUT/persist_tmpfs.json, persist_disk.json
#   3. bench_restore.py (restore throughput; tmpfs, then disk)     -> $OUT/restore_tmpfs.json, restore_disk.json
#   4. bench_compression.py (zstd-planes ratio and speed, CPU)     -> $OUT/compression.json
#   5. on a host with 2 GPUs or more: bench_stall.py on one GPU with half the state, then
#      bench_stall_dist.py under torchrun on 2 (FSDP2, sharded; interleaved) -> $OUT/stall_1gpu_half.json, stall_dist.json
# (order: stall, persist_tmpfs, restore_tmpfs, compression, persist_disk, restore_disk, stall_dist)
# and prints the compact tables last. Stages run in that order under one time budget (BUDGET_S); a stage
# that runs out of time is interrupted and its partial JSON is kept (tables say PARTIAL).
#
# Environment (defaults in brackets):
#   OUT [./bench-out]  WHEELS [.wheels]  PYTHON [python3]  STATE_GB [5] (0.5 / 5 / 20 are presets)
#   STAGES [all]: comma list of the stages to run (stall,persist_tmpfs,restore_tmpfs,compression,
#            persist_disk,restore_disk,stall_dist), e.g. to split a run over several shorter leases with one OUT
#   BUDGET_S [2400 x SCALE]  TMPFS_DIR [/dev/shm/ckd-bench]  DISK_DIR [/var/tmp/ckd-bench]  SKIP_DISK [0]
#   stall:   EVERY [100]  CKPTS [3]  STEPS [(CKPTS+1)*EVERY-1]  METHODS [none,checkpointd,...,none,checkpointd,checkpointd_device,none]  D L B S
#            CKD_DEVICE_KWARGS (JSON kwargs that turn on device staging; auto-detected if unset)
#   persist/restore: REPEAT [2] (persist)  RESTORE_REPEAT [5] (tmpfs)  DISK_RESTORE_REPEAT [3]  RAW_THREADS [8,max]
#            PERSIST_METHODS  RESTORE_METHODS  DISK_ROUNDS [3]
#   stall_dist: DIST_EVERY [60]  DIST_CKPTS [6]  DIST_METHODS [none,checkpointd,none,checkpointd,none,checkpointd,none]
#   all checkpointd runs: CKD_KWARGS (JSON object passed to CheckpointManager; option groups as objects,
#            e.g. {"io": {"file_threads": 8}} for io=checkpointd.IOOptions(file_threads=8))
#   PREFAULT_GB [auto]: host memory the first stage run writes once before timing (a fresh VM maps its
#            pages on first write, ~4x slower: benchmarks/common.py prefault_host_memory); later stages skip it
#   BENCH_ARGS: extra arguments for every benchmark (e.g. "--cpu --tiny" to smoke-test this script)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/bench-out}
WHEELS=${WHEELS:-.wheels}
STATE_GB=${STATE_GB:-5}
# Stage caps and the default budget grow with the state: SCALE = ceil(STATE_GB / 5), at least 1. The
# caps only stop a stage that hangs or a host far slower than ours. At 5 GB on a 16-core H200 host the
# stall stage takes ~265 s, stall and persist_tmpfs ~350 s together, restore_tmpfs with 5 repetitions
# 330-380 s (the prefault included), compression well under its cap, persist_disk (2 rounds) ~225 s;
# stall_dist on a 2x H200 host ~360 s with ten runs a side (the default is seven). To fit a time limit
# set BUDGET_S lower (later stages are then skipped or cut, and the summary says so) or split the run
# with STAGES.
SCALE=$(awk -v g="$STATE_GB" 'BEGIN { s = g / 5; print (s < 1) ? 1 : int(s + 0.999) }')
BUDGET_S=${BUDGET_S:-$(( 2400 * SCALE ))}
TMPFS_DIR=${TMPFS_DIR:-/dev/shm/ckd-bench}
DISK_DIR=${DISK_DIR:-/var/tmp/ckd-bench}
SKIP_DISK=${SKIP_DISK:-0}
ALL_STAGES="stall,persist_tmpfs,restore_tmpfs,compression,persist_disk,restore_disk,stall_dist"
STAGES=${STAGES:-$ALL_STAGES}
for s in ${STAGES//,/ }; do
    case ",$ALL_STAGES," in *",$s,"*) ;; *) echo "run_gpu.sh: unknown stage '$s' in STAGES (known: $ALL_STAGES)" >&2; exit 2 ;; esac
done
export RAW_THREADS=${RAW_THREADS:-8,max}
export REPEAT=${REPEAT:-2}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
START=$(date +%s)

if [ -d "$WHEELS" ]; then
    echo "== installing wheels from $WHEELS"
    # one at a time: a wheel missing from $WHEELS must not stop the others (zlib-ng: without it every
    # checksum runs at zlib's ~4 GB/s a core; a restore verifies every byte first).
    for pkg in zstandard fsspec zlib-ng; do
        "$PY" -m pip install --no-index --find-links "$WHEELS" "$pkg" 2>&1 | tail -n 1
    done
    # the stall benchmark's Lightning rows: `lightning` is pure Python; its dependencies are those of
    # the pytorch-lightning package CUDA images ship (without either the rows say "skipped")
    "$PY" -m pip install --no-deps --no-index --find-links "$WHEELS" lightning 2>&1 | tail -n 1
fi
echo "== building the native libraries in place"
"$PY" setup.py -q build_ext --inplace 2>&1 | tail -n 3
"$PY" - <<'EOF'
import torch
print("== torch", torch.__version__, "cuda", torch.version.cuda, "|",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE (benchmarks fall back to CPU)")
for m in ("zstandard", "fsspec", "checkpointd"):
    try:
        mod = __import__(m); print("   ", m, getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print("   ", m, "NOT IMPORTABLE:", e)
try:
    from checkpointd.codecs import crc
    note = "" if crc.CRC32_IMPLEMENTATION != "zlib" else " (slow: zlib-ng, a dependency, is missing)"
    print("    CRC-32 by", crc.CRC32_IMPLEMENTATION + note)
except Exception as e:  # noqa: BLE001
    print("    CRC-32 implementation unknown:", e)
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
df -h "$(dirname "$TMPFS_DIR")" "$(dirname "$DISK_DIR")" 2>/dev/null | tee "$OUT/df.txt"

# stage NAME CAP_SECONDS ARGS...: run one benchmark under min(CAP, what is left of BUDGET_S); with
# STAGE_OUT=X before the call, a benchmark of stage NAME that writes $OUT/X.json (a stage's second part)
stage() {
    local gate=$1 cap=$2; shift 2
    local name=${STAGE_OUT:-$gate}
    case ",$STAGES," in *",$gate,"*) ;; *) echo "== $name: not in STAGES"; return ;; esac
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    local t=$(( cap < left ? cap : left ))
    if [ "$t" -lt 20 ]; then
        echo "== $name: skipped, time budget spent"; return
    fi
    echo "== $name (limit ${t}s): $*"
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=30 "$t" "$PY" "$@" ${BENCH_ARGS:-} --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && echo "== $name: exit status $rc (124 = ran out of time; partial JSON kept)"
    export PREFAULT_GB=0  # the first stage has written the host's memory once; it stays mapped
    return 0
}

stage stall $(( 420 * SCALE )) benchmarks/bench_stall.py --state-gb "$STATE_GB" --dir "$TMPFS_DIR/stall"
stage persist_tmpfs $(( 240 * SCALE )) benchmarks/bench_persist.py --state-gb "$STATE_GB" --dirs "$TMPFS_DIR/persist" \
    ${PERSIST_METHODS:+--methods "$PERSIST_METHODS"}
# restores: best of RESTORE_REPEAT (5 on tmpfs, DISK_RESTORE_REPEAT 3 on disk); the first restore of a
# process pins its buffers, so a few repetitions leave several warm samples and one slow sample cannot
# decide a row (warm samples of one row can spread 220-334 ms; the table prints the median beside the
# best); each manager-based repetition waits 3 s after the last close (bench_restore.py --settle-s) and
# the host-verified fresh-process row takes ~12 s a repetition, hence the longer limits
stage restore_tmpfs $(( 600 * SCALE )) benchmarks/bench_restore.py --state-gb "$STATE_GB" --dirs "$TMPFS_DIR/restore" \
    --repeat "${RESTORE_REPEAT:-5}" ${RESTORE_METHODS:+--methods "$RESTORE_METHODS"}
stage compression 150 benchmarks/bench_compression.py --repeat 2
if [ "$SKIP_DISK" != "1" ]; then
    # disks drift during a run: interleaved rounds of one repetition each (bench_persist --rounds)
    stage persist_disk $(( 420 * SCALE )) benchmarks/bench_persist.py --state-gb "$STATE_GB" --dirs "$DISK_DIR/persist" \
        --repeat 1 --rounds "${DISK_ROUNDS:-3}" ${PERSIST_METHODS:+--methods "$PERSIST_METHODS"}
    stage restore_disk $(( 420 * SCALE )) benchmarks/bench_restore.py --state-gb "$STATE_GB" --dirs "$DISK_DIR/restore" \
        --repeat "${DISK_RESTORE_REPEAT:-3}" ${RESTORE_METHODS:+--methods "$RESTORE_METHODS"}
fi
# Two GPUs (the target: the per-rank stall about one GPU's with half the state): the reference on one GPU
# first, then the same methods on two under torchrun, interleaved with `none` runs (bench_stall_dist.py's
# docstring says why); CPU mode (BENCH_ARGS=--cpu ...) runs it on gloo as a smoke test.
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
case " ${BENCH_ARGS:-} " in *" --cpu "*) DIST_OK=1 ;; *) DIST_OK=$(( NGPU >= 2 )) ;; esac
if [ "$DIST_OK" = "1" ]; then
    HALF_GB=$(awk -v g="$STATE_GB" 'BEGIN { print g / 2 }')
    DIST_ARGS=(--every "${DIST_EVERY:-60}" --ckpts "${DIST_CKPTS:-6}"
               --methods "${DIST_METHODS:-none,checkpointd,none,checkpointd,none,checkpointd,none}")
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-0} STAGE_OUT=stall_1gpu_half stage stall_dist $(( 300 * SCALE )) \
        benchmarks/bench_stall.py --state-gb "$HALF_GB" --dir "$TMPFS_DIR/stall-1gpu" "${DIST_ARGS[@]}"
    stage stall_dist $(( 480 * SCALE )) -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/bench_stall_dist.py \
        --state-gb "$STATE_GB" --dir "$TMPFS_DIR/stall-dist" --ref-json "$OUT/stall_1gpu_half.json" "${DIST_ARGS[@]}"
else
    echo "== stall_dist: skipped, needs 2 GPUs (found $NGPU)"
fi
rm -rf "$TMPFS_DIR" "$DISK_DIR"

echo
echo "################ summary ($(( $(date +%s) - START )) s) ################"
OUT="$OUT" "$PY" - <<'EOF'
import json, os, sys
sys.path.insert(0, "benchmarks")
import bench_stall, bench_persist, bench_restore
out = os.environ["OUT"]
for name, mod in [("stall", bench_stall), ("persist_tmpfs", bench_persist), ("restore_tmpfs", bench_restore),
                  ("persist_disk", bench_persist), ("restore_disk", bench_restore), ("compression", None),
                  ("stall_dist", None)]:
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p):
        print(f"\n== {name}: no result ({p} missing)")
        continue
    r = json.load(open(p))
    try:
        text = r.get("table") or mod.summarise(r)
        if name == "stall" and not r.get("table"):
            text += "\n" + bench_stall.ckd_stats_lines(r["runs"])
    except Exception as e:  # noqa: BLE001
        text = f"\n== {name}: cannot summarise ({e!r}); see {p}"
    print(text + ("" if r.get("complete") else f"\n   PARTIAL: {name} interrupted; rows above are complete ones"))
print(f"\nJSON and logs in {out}")
EOF
