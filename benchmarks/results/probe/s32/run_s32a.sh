python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc; df -h /dev/shm | tail -1; uname -r
python3 -c "import zlib_ng, zstandard, torch; print('zlib_ng ok, torch', torch.__version__, torch.version.cuda)"
mkdir -p $OUT/s32a
P=benchmarks/results/probe/s32
rm -rf /dev/shm/ckd*
timeout 240 python3 $P/persist_probe.py --gb 5 --saves 5 --json $OUT/s32a/persist-s32a.json 2>&1 | tee $OUT/s32a/persist-s32a.log | grep -v "^  save" 
echo "exit ${PIPESTATUS[0]}"
grep "^  save" $OUT/s32a/persist-s32a.log | cut -c1-150
rm -rf /dev/shm/ckd*
date -u
cd $OUT && tar czf s32a.tgz s32a && rm -rf s32a
