python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
date -u; nvidia-smi -L; git log --oneline -1; nproc
timeout 200 python3 .probe/mirror_probe_s19c.py 4.83 $OUT/mirror-s19c.json 2>&1 | grep -v '^{' 
date -u
