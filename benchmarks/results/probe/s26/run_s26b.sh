python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; lscpu | grep -i "^CPU(s)\|Thread(s) per core\|Core(s) per socket\|Socket(s)\|NUMA node" ; nvidia-smi topo -m | head -5
mkdir -p $OUT/s26b
echo "== GPU tests (tests/gpu), one GPU"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -4
date -u
T4=checkpointd@CHECKPOINTD_PERSIST_THREADS=4
M=none,checkpointd,$T4,io_only_reuse,none,checkpointd,$T4,io_only_reuse,none
echo "== 2 GPUs, interleaved, step counters"
rm -rf /dev/shm/ckd*
timeout 330 torchrun --nproc_per_node=2 benchmarks/bench_stall_dist.py --state-gb 5 --every 60 --ckpts 5 --prefault-gb 0 --step-counters \
  --methods $M --dir /dev/shm/ckd-dist --json $OUT/s26b/stall-dist-variants.json > $OUT/s26b/stall-dist-variants.log 2>&1
echo "exit $?"; grep -v "^\[stall-dist\] " $OUT/s26b/stall-dist-variants.log | grep -v "stats()\|construction\|staging arena" | tail -42 | cut -c1-300
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s26b.tgz s26b && rm -rf s26b
