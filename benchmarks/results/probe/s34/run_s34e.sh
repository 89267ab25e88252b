# Session 34, call e: run_gpu.sh's restore_disk stage (ext4), three rows only (the device time left):
# the raw reads, checkpointd warm and in a fresh process; the ext4 restore reads, checksums on the host,
# then copies through copy_pairs' bounce (now the native upload).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s34e
rm -rf /dev/shm/ckd* /var/tmp/ckd*
echo "== run_gpu.sh restore_disk stage, 3 methods"
OUT=$OUT/s34e/rungpu WHEELS=/nonexistent STAGES=restore_disk RESTORE_METHODS=raw,checkpointd,checkpointd_cold BUDGET_S=250 timeout 265 bash benchmarks/run_gpu.sh > $OUT/s34e/rungpu-s34e.log 2>&1
echo "exit $?"; grep -A10 "^-- /var" $OUT/s34e/rungpu/restore_disk.log | cut -c1-200
python3 - <<'PY' $OUT/s34e/rungpu/restore_disk.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["dirs"][0]["rows"]:
    print(f'{r["method"][:50]:50s}', " ".join(f"{t*1e3:.1f}" for t in r.get("times_s", [])), r.get("error", ""))
PY
rm -rf /dev/shm/ckd* /var/tmp/ckd*
date -u
cd $OUT && tar czf s34e.tgz s34e && rm -rf s34e
