"""Diagnosis, not a benchmark: what allocating a file's pages costs here, against writing pages that exist.

Prints the host's CPU topology, its virtio devices (a ``virtio_balloon`` with free page reporting hands
freed guest memory back to the hypervisor), memory and tmpfs settings, then times on ``/dev/shm``:
a new file (``posix_fallocate``, then threads copying into a mapping of it, then ``unlink``) three times,
the same file written over three times, and the same two cases with positional writes. This is why
checkpointd recycles retired checkpoint files (``checkpointd.storage.recycle``; ``benchmarks/RESULTS.md``, session 10).

    python benchmarks/diagnose_file_pages.py [GB (4)] [THREADS (8)]
"""
import glob, mmap, os, subprocess, sys, time, threading
import numpy as np

def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:
        return f"<{e}>"

print("== lscpu"); print(sh("lscpu | egrep -i 'model name|socket|core|thread|numa|^cpu\\(s\\)|mhz|l3'"))
print("== virtio drivers:", os.listdir("/sys/bus/virtio/drivers") if os.path.exists("/sys/bus/virtio/drivers") else None)
for d in glob.glob("/sys/bus/virtio/devices/*"):
    print(d, sh(f"cat {d}/device {d}/features 2>/dev/null | tr '\\n' ' '"))
print("== vmstat"); print(sh("egrep -i 'balloon|report|thp_file|nr_shmem|compact_stall|pgfault|pgmajfault' /proc/vmstat"))
print("== meminfo"); print(sh("egrep 'MemTotal|MemFree|Shmem|Hugepage|AnonHuge|ShmemHuge' /proc/meminfo"))
print("== shmem thp:", sh("cat /sys/kernel/mm/transparent_hugepage/shmem_enabled /sys/kernel/mm/transparent_hugepage/enabled"))
print("== mounts:", sh("grep -E ' /dev/shm | /tmp ' /proc/mounts"))
print("== uname:", sh("uname -r"))
print("== dmesg:", sh("dmesg 2>&1 | egrep -i 'balloon|virtio_mem|hotplug|report' | tail -5"))

GB = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
THREADS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
n = int(GB * (1 << 30)) // (1 << 21) * (1 << 21)
src = np.full(n, 7, dtype=np.uint8)

def fill(path, trunc):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if trunc else 0), 0o644)
    t0 = time.perf_counter(); os.posix_fallocate(fd, 0, n); t1 = time.perf_counter()
    m = mmap.mmap(fd, n, flags=mmap.MAP_SHARED); dst = np.frombuffer(m, dtype=np.uint8)
    step = n // THREADS
    def part(i):
        dst[i * step:(i + 1) * step] = src[i * step:(i + 1) * step]
    ts = [threading.Thread(target=part, args=(i,)) for i in range(THREADS)]
    [t.start() for t in ts]; [t.join() for t in ts]
    t2 = time.perf_counter(); dst = None; m.close(); os.close(fd)  # noqa: F841 - frees the view before the unmap
    return t1 - t0, t2 - t1

p = "/dev/shm/diagnose_file_pages.bin"
print(f"== {n / 1e9:.2f} GB, {THREADS} threads copying into a mapping")
for r in range(3):
    fa, cp = fill(p, True)
    print(f"new file   round {r}: fallocate {fa*1e3:7.1f} ms ({n/fa/1e9:5.2f} GB/s)  copy {cp*1e3:7.1f} ms ({n/cp/1e9:5.2f} GB/s)")
    t = time.perf_counter(); os.unlink(p); print(f"   unlink {1e3*(time.perf_counter()-t):.1f} ms"); time.sleep(3)
fill(p, True)
for r in range(3):
    fa, cp = fill(p, False)
    print(f"same file  round {r}: fallocate {fa*1e3:7.1f} ms  copy {cp*1e3:7.1f} ms ({n/cp/1e9:5.2f} GB/s)")
os.unlink(p)

def pfill(path, trunc, chunk=64 << 20):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_TRUNC if trunc else 0), 0o644)
    mv = memoryview(src)
    offs = list(range(0, n, chunk)); lock = threading.Lock()
    def lane():
        while True:
            with lock:
                if not offs: return
                o = offs.pop()
            m = mv[o:o + chunk]
            while len(m):
                k = os.pwrite(fd, m, o); m = m[k:]; o += k
    t0 = time.perf_counter()
    ts = [threading.Thread(target=lane) for _ in range(THREADS)]
    [t.start() for t in ts]; [t.join() for t in ts]
    dt = time.perf_counter() - t0; os.close(fd); return dt

for r in range(3):
    dt = pfill(p, True)
    print(f"pwrite new file  round {r}: {dt*1e3:7.1f} ms ({n/dt/1e9:5.2f} GB/s)")
    os.unlink(p); time.sleep(3)
pfill(p, True)
for r in range(3):
    dt = pfill(p, False)
    print(f"pwrite same file round {r}: {dt*1e3:7.1f} ms ({n/dt/1e9:5.2f} GB/s)")
os.unlink(p)
print("== vmstat after"); print(sh("egrep -i 'balloon|report|pgfault' /proc/vmstat"))
