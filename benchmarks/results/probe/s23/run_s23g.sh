python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; nproc
A="--state-gb 5 --every 100 --ckpts 3 --dir /dev/shm/ckd-stall --methods none,checkpointd"
echo "== A: the defaults, files made ahead once the arena is page-locked (new), with a timeline"
timeout 150 python3 .probe/host25_timeline.py $OUT/tl-default-s23g.json -- $A --prefault-gb 20 --json $OUT/stall-default-s23g.json 2>&1 | grep -E "^none|^checkpointd|^EV|^SAVE|rror|targets" | cut -c1-220
date -u
echo "== B: CHECKPOINTD_FILES_AHEAD=0, with a timeline"
CHECKPOINTD_FILES_AHEAD=0 timeout 150 python3 .probe/host25_timeline.py $OUT/tl-noahead-s23g.json -- $A --prefault-gb 0 --json $OUT/stall-noahead-s23g.json 2>&1 | grep -E "^none|^checkpointd|^EV|^SAVE|rror|targets" | cut -c1-220
date -u
