# Session 36, call b: device staging at 20 GB beside its floors in one run: clone_only (the clone and its
# paced copy to pinned memory, nothing written) and io_only_reuse (the writing of 20 GB alone).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s36b
rm -rf /dev/shm/ckd*
echo "== 20 GB stall: device staging and its floors"
timeout 560 python3 benchmarks/bench_stall.py --state-gb 20 --every 100 --ckpts 3 --prefault-gb 40 --dir /dev/shm/ckd-bench/stall --methods ${METHODS20:-none,checkpointd_device,clone_only,io_only_reuse,none} --json $OUT/s36b/stall-20gb-s36b.json > $OUT/s36b/stall-20gb-s36b.log 2>&1
echo "exit $?"; grep -B2 -A14 "stall ms" $OUT/s36b/stall-20gb-s36b.log | cut -c1-220 | tail -30
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s36b.tgz s36b && rm -rf s36b
