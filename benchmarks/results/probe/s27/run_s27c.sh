python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
mkdir -p $OUT/s27c
M=none,checkpointd,io_only_reuse,copy_only,none,checkpointd,io_only_reuse,copy_only,none,checkpointd,io_only_reuse,copy_only,none
echo "== 2 GPUs, interleaved: checkpointd against its floors (the writing alone, the copy alone)"
rm -rf /dev/shm/ckd*
timeout 520 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 6 --prefault-gb 0 \
  --methods $M --dir /dev/shm/ckd-dist --ref-json benchmarks/results/probe/s27/stall-1gpu-half-s27b.json --json $OUT/s27c/stall-dist-floors.json > $OUT/s27c/stall-dist-floors.log 2>&1
echo "exit $?"; sed -n '/^interleaved, rank 0/,$p' $OUT/s27c/stall-dist-floors.log | grep -v "stats()\|construction\|staging arena" | head -20 | cut -c1-230
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s27c.tgz s27c && rm -rf s27c
