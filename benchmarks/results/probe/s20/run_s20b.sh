python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L
timeout 300 python3 .probe/restore_chunks.py $OUT/chunks-s20b.json 16:4:16,8:4:16,4:4:16,2:8:16,1:16:16,4:4:8,8:4:8,32:2:16 4 2>&1 | grep -v "^round"
date -u
