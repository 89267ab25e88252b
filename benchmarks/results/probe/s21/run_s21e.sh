export PYTHONUNBUFFERED=1
date -u; nvidia-smi -L; nvidia-smi topo -m 2>&1 | head -8
timeout 200 python3 .probe/d2h_pair.py 2.42
date -u
