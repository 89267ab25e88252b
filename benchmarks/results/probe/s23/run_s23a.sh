python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; uname -r
B="--state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-h25 --prefault-gb 20 --methods none,checkpointd_host25"
echo "== A host25 timeline, slab populated in the persist process (new)"
timeout 120 python3 .probe/host25_timeline.py $OUT/tl-pop-s23a.json -- $B --json $OUT/host25-pop-s23a.json 2>&1 | grep -E "^none|^checkpointd|^EV|^SAVE|rror" | cut -c1-260
date -u
echo "== B host25 timeline, not populated (as before)"
timeout 120 python3 .probe/host25_timeline.py $OUT/tl-nopop-s23a.json --no-populate -- $B --json $OUT/host25-nopop-s23a.json 2>&1 | grep -E "^none|^checkpointd|^EV|^SAVE|rror" | cut -c1-260
date -u
