"""Shared scaffolding for the checkpointd benchmarks (not library code).

Everything a benchmark needs besides its own measurement loop: device and synchronisation, the
reference workload (transformer blocks with LayerNorm, QKV, causal attention, 4x MLP; fp32 parameters;
AdamW), a state builder of a given size, the host-memory probes, the checkpointd constructor, plain-text
tables and JSON output.

The benchmarks use checkpointd's public API. Extra constructor keyword arguments come from
``--ckd-kwargs`` as JSON; the grouped options are given as objects (``{"staging": {"device_budget_bytes":
N}}``, ``{"io": {...}}``, ``{"distributed": {...}}``) and become ``checkpointd.StagingOptions``,
``IOOptions`` and ``DistributedOptions`` (:func:`manager_kwargs`). An argument the constructor does not
accept is dropped with a printed note.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import json
import os
import platform
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------
# device


class Dev:
    """The device a benchmark runs on, and how to wait for it."""

    def __init__(self, cpu: bool = False):
        self.cuda = torch.cuda.is_available() and not cpu
        self.device = torch.device("cuda") if self.cuda else torch.device("cpu")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @property
    def name(self) -> str:
        if self.cuda:
            return torch.cuda.get_device_name(0)
        return f"CPU ({platform.processor() or platform.machine()})"


def env_info(dev: Dev) -> dict:
    """What the reader of a result needs to reproduce it."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": dev.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if dev.cuda else None,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
    }
    ckd = try_import_checkpointd()
    info["checkpointd"] = getattr(ckd, "__version__", "unknown") if not isinstance(ckd, str) else f"unavailable: {ckd}"
    if not isinstance(ckd, str):
        from checkpointd.codecs import crc  # noqa: PLC0415

        # restores and compressed saves checksum every byte: zlib's CRC-32 (~4 GB/s a core) makes both slower
        info["crc32"] = crc.CRC32_IMPLEMENTATION
    return info


PREFAULT_ENV = "PREFAULT_GB"


def add_prefault_arg(p: Any) -> None:
    """``--prefault-gb`` (environment ``PREFAULT_GB``) on a benchmark's argument parser."""
    p.add_argument("--prefault-gb", default=env_str(PREFAULT_ENV, None),
                   help="GiB of host memory to write once before timing (fresh VMs map pages on first write; "
                        "default auto on CUDA = 75%% of MemAvailable, 0 on CPU)")


def prefault_host_memory(spec: str | None, dev: Dev) -> dict:
    """Write to most of the host's free memory once, then free it, before anything is timed.

    Why: on a freshly started VM the first write to each page of guest memory is slow (the
    hypervisor maps it in). On an H200 host never-touched memory is written at 4.7-5.3 GiB/s and the
    same amount touched again at 18.5-20.1 GiB/s, and a stall run started in a host's first minutes
    measures 53-86 ms a checkpoint for writing the files alone (``io_only_reuse``) against -0.2-4.0 ms
    for the same method later in that run. Whichever method
    runs first (baseline or checkpointd) pays for the pages it touches first, so the comparison
    would depend on the order. ``spec``: GiB to touch, ``auto`` (the default on CUDA: 75 % of
    ``MemAvailable``, 1 GiB blocks held until the end) or ``0`` (the default on CPU: skip).
    """
    spec = (spec or ("auto" if dev.cuda else "0")).strip().lower()
    if spec == "auto":
        avail = proc_kb_field("/proc/meminfo", "MemAvailable")
        gib = int(0.75 * avail) >> 30 if avail else 0
    else:
        try:
            gib = int(float(spec))
        except ValueError:
            raise SystemExit(f"--prefault-gb / {PREFAULT_ENV}={spec!r}: expected a number of GiB, 'auto' or 0") from None
    if gib <= 0:
        return {"gib": 0}
    blocks = []
    t0 = time.perf_counter()
    try:
        for _ in range(gib):
            blocks.append(torch.empty(1 << 28, dtype=torch.float32).fill_(1.0))
    except RuntimeError:  # out of memory: what was touched still counts
        pass
    secs = time.perf_counter() - t0
    touched = len(blocks)
    del blocks
    gc.collect()
    out = {"gib": touched, "secs": round(secs, 2), "gib_per_s": round(touched / secs, 1) if secs > 0 else None}
    print(f"[prefault] wrote {touched} GiB of host memory once in {secs:.1f} s ({out['gib_per_s']} GiB/s; "
          f"first writes to a fresh VM's pages are slow: benchmarks/common.py prefault_host_memory)", flush=True)
    return out


def env_int(name: str, default: int | None) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


def env_float(name: str, default: float | None) -> float | None:
    v = os.environ.get(name)
    return float(v) if v not in (None, "") else default


def env_str(name: str, default: str | None) -> str | None:
    v = os.environ.get(name)
    return v if v not in (None, "") else default


# ----------------------------------------------------------------------------------------------------
# reference workload


class Block(nn.Module):
    """One transformer block: LayerNorm, QKV projection, causal attention, 4x MLP."""

    def __init__(self, d: int, device: Any = None):
        super().__init__()
        self.ln = nn.LayerNorm(d, device=device)
        self.a = nn.Linear(d, 4 * d, device=device)
        self.b = nn.Linear(4 * d, d, device=device)
        self.q = nn.Linear(d, 3 * d, device=device)
        self.o = nn.Linear(d, d, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        q, k, v = self.q(h).chunk(3, -1)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.b(F.gelu(self.a(self.ln(x))))


def params_per_block(d: int) -> int:
    return 12 * d * d + 11 * d


def state_bytes_for(d: int, layers: int) -> int:
    """fp32 parameters + AdamW exp_avg + exp_avg_sq."""
    return 12 * params_per_block(d) * layers


# --state-gb presets: about 0.5 / 5 / 20 GB of fp32 AdamW state (params + two moments).
STATE_PRESETS = {
    0.5: (1024, 3),   # 0.45 GB
    5.0: (2048, 8),   # 4.83 GB  (the reference workload)
    20.0: (2048, 33),  # 19.9 GB
}


def shape_for_gb(gb: float) -> tuple[int, int]:
    """(D, L) for about ``gb`` GB of state: a preset if one matches, else D=2048 and enough layers."""
    for k, v in STATE_PRESETS.items():
        if abs(k - gb) < 1e-6:
            return v
    d = 2048 if gb >= 1 else 1024
    layers = max(1, round(gb * 1e9 / state_bytes_for(d, 1)))
    return d, layers


def make_model(d: int, layers: int, device: torch.device, *, seed: int = 0, fast_init: bool = False) -> nn.Sequential:
    """The reference model. ``fast_init`` skips kaiming init (built on meta, filled with randn * 0.02)."""
    torch.manual_seed(seed)
    if not fast_init:
        return nn.Sequential(*[Block(d) for _ in range(layers)]).to(device)
    with torch.device("meta"):
        m = nn.Sequential(*[Block(d) for _ in range(layers)])
    m = m.to_empty(device=device)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02)
    return m


def make_optimizer(model: nn.Module, dev: Dev) -> torch.optim.Optimizer:
    if dev.cuda:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def fill_adam_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Populate the optimizer state with one real AdamW step on random gradients (realistic moments)."""
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)


def pin_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Move a CPU model's parameters and the optimizer's tensors into pinned memory, in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.pin_memory()
        for st in opt.state.values():
            for k, v in list(st.items()):
                if torch.is_tensor(v) and v.numel() > 1:
                    st[k] = v.pin_memory()


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    ts = [p for p in model.parameters()]
    if opt is not None:
        for st in opt.state.values():
            ts += [v for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    return ts


def nbytes(ts: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def build_train_state(gb: float | None, d: int | None, layers: int | None, dev: Dev, *,
                      on: str = "device", pinned: bool = True) -> tuple[nn.Module, torch.optim.Optimizer, dict]:
    """A model + AdamW with populated state, on the device (``on="device"``) or on CPU (pinned if CUDA)."""
    if d is None or layers is None:
        d0, l0 = shape_for_gb(gb if gb is not None else 5.0)
        d, layers = d or d0, layers or l0
    where = dev.device if on == "device" else torch.device("cpu")
    model = make_model(d, layers, where, fast_init=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=(where.type == "cuda"))
    fill_adam_state(model, opt)
    if where.type == "cpu" and dev.cuda and pinned:
        pin_state(model, opt)
    dev.sync()
    info = {"D": d, "L": layers, "params": sum(p.numel() for p in model.parameters()),
            "state_bytes": nbytes(state_tensors(model, opt)), "tensors": len(state_tensors(model, opt)),
            "state_on": str(where), "pinned": bool(where.type == "cpu" and dev.cuda and pinned)}
    return model, opt, info


# ----------------------------------------------------------------------------------------------------
# host memory


def proc_kb_field(path: str, key: str) -> int | None:
    """A ``Key:  N kB`` line of a /proc file (``/proc/meminfo``, ``/proc/self/status``), in bytes (Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


VMSTAT_KEYS = ("pgfault", "pgmajfault", "pgalloc_normal", "pgfree", "pgscan_direct", "pgsteal_direct",
               "pgscan_kswapd", "compact_stall", "compact_fail", "compact_success", "pgmigrate_success",
               "thp_fault_alloc", "thp_fault_fallback", "workingset_refault_file")
VMSTAT_PREFIXES = ("allocstall",)


class StepCounters:
    """Kernel counters sampled between training steps: what the host did during each step (Linux).

    Why: a checkpoint's files being written can draw bursts of 20-76 ms in the training steps beside
    them, and the writing alone (no library code in the training process) draws them about as often.
    Per step this records the training
    thread's time runnable but waiting for a CPU (``/proc/thread-self/schedstat``), its involuntary and
    voluntary context switches, the process's minor faults and CPU time (all its threads: the library's
    own threads in the training process show here), the host's interrupts, context switches and TLB
    shootdowns (``/proc/stat``, ``/proc/interrupts``) and host-wide memory counters (``/proc/vmstat``:
    direct reclaim, compaction, page allocation), so a burst can be set against them.
    Reading the files costs ~0.1-0.3 ms, spent between steps (after a step's clock stops).
    Counters a kernel does not have are left out.
    """

    def __init__(self) -> None:
        self.last = self.read()
        self.deltas: dict[str, list[float]] = {k: [] for k in self.last}

    @staticmethod
    def read() -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            with open("/proc/thread-self/schedstat") as f:
                run_ns, wait_ns, _slices = (int(x) for x in f.read().split()[:3])
            out["run_ms"], out["wait_ms"] = run_ns / 1e6, wait_ns / 1e6
        except (OSError, ValueError):
            pass
        try:
            with open("/proc/thread-self/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        key, value = line.split(":")
                        out["invol_switches" if key.startswith("non") else "vol_switches"] = float(value)
        except (OSError, ValueError):
            pass
        try:
            with open("/proc/self/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out["proc_minflt"], out["proc_majflt"] = float(fields[7]), float(fields[9])
            tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
            out["proc_user_ms"], out["proc_sys_ms"] = float(fields[11]) * tick_ms, float(fields[12]) * tick_ms
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open("/proc/stat") as f:
                for line in f:
                    if line.startswith(("intr ", "ctxt ")):
                        key, value = line.split()[:2]
                        out["host_" + key] = float(value)
        except (OSError, ValueError):
            pass
        try:
            with open("/proc/interrupts") as f:
                for line in f:
                    if line.lstrip().startswith("TLB:"):
                        out["host_tlb_shootdowns"] = float(sum(int(x) for x in line.split()[1:] if x.isdigit()))
                        break
        except (OSError, ValueError):
            pass
        try:
            with open("/proc/vmstat") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key in VMSTAT_KEYS or key.startswith(VMSTAT_PREFIXES):
                        out[key] = float(value)
        except (OSError, ValueError):
            pass
        return out

    def sample(self) -> None:
        """One step's deltas (call once after each step)."""
        now = self.read()
        for k, series in self.deltas.items():
            series.append(round(now.get(k, 0.0) - self.last.get(k, 0.0), 3))
        self.last = now


def vmstat(key: str) -> int | None:
    """One host-wide counter of ``/proc/vmstat`` (``None`` where there is none, as off Linux)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def slow_step_profile(step_s: list[float], deltas: dict[str, list[float]], over_ms: float = 3.0) -> dict | None:
    """Mean counter deltas on the steps more than ``over_ms`` above the run's median step, and on the rest.

    ``None`` when no step is that slow. Counters that never moved are left out.
    """
    if not step_s or not deltas:
        return None
    ms = [s * 1e3 for s in step_s]
    med = sorted(ms)[len(ms) // 2]
    slow = [i for i, v in enumerate(ms) if v > med + over_ms]
    if not slow:
        return None
    slow_set = set(slow)
    rest = [i for i in range(len(ms)) if i not in slow_set]
    out: dict[str, Any] = {"slow_steps": len(slow), "other_steps": len(rest), "over_ms": over_ms, "per_step": {}}
    for k, series in deltas.items():
        if len(series) != len(ms) or not any(series):
            continue
        a = sum(series[i] for i in slow) / len(slow)
        b = sum(series[i] for i in rest) / len(rest) if rest else 0.0
        out["per_step"][k] = [round(a, 3), round(b, 3)]
    return out


def proc_status_bytes(key: str) -> int | None:
    """VmRSS / VmHWM / VmLck ... of this process, in bytes (Linux)."""
    return proc_kb_field("/proc/self/status", key)


def host_memory(dev: Dev) -> dict:
    """Pinned bytes held by PyTorch's caching host allocator (if this torch reports it) and process RSS.

    Pinned memory that a library registers itself (cudaHostRegister) is not in the allocator's numbers;
    it shows in RSS only.
    """
    out: dict[str, Any] = {"rss_bytes": proc_status_bytes("VmRSS"), "rss_peak_bytes": proc_status_bytes("VmHWM")}
    if dev.cuda and hasattr(torch.cuda, "host_memory_stats"):
        try:
            s = torch.cuda.host_memory_stats()
            out["pinned_bytes"] = s.get("allocated_bytes.current")
            out["pinned_peak_bytes"] = s.get("allocated_bytes.peak")
            out["pinned_allocs_total"] = s.get("num_host_alloc", s.get("allocations.allocated"))
        except Exception as e:  # noqa: BLE001 - a probe, never fatal
            out["pinned_error"] = repr(e)[:200]
    return out


# ----------------------------------------------------------------------------------------------------
# checkpointd, through its public API


def try_import_checkpointd() -> Any:
    """The ``checkpointd`` module, or a string saying why it cannot be imported."""
    try:
        import checkpointd  # noqa: PLC0415
        getattr(checkpointd, "CheckpointManager")
        return checkpointd
    except ModuleNotFoundError as e:
        if e.name == "checkpointd":
            return ("checkpointd is not importable: run with PYTHONPATH=src from the repository root, "
                    "or pip install -e .")
        return f"checkpointd failed to import: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"checkpointd failed to import: {type(e).__name__}: {e}"


def require_checkpointd() -> Any:
    ckd = try_import_checkpointd()
    if isinstance(ckd, str):
        raise RuntimeError(ckd)
    return ckd


def manager_params() -> tuple[set[str], bool]:
    """Names the CheckpointManager constructor accepts, and whether it takes **kwargs."""
    ckd = require_checkpointd()
    sig = inspect.signature(ckd.CheckpointManager)
    names = set(sig.parameters)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


OPTION_GROUPS = {"staging": "StagingOptions", "io": "IOOptions", "distributed": "DistributedOptions"}
"""Constructor arguments that take a grouped options object, and the checkpointd class of each."""


def merge_kwargs(*parts: dict) -> dict:
    """Keyword arguments in plain form (option groups as dicts), later parts winning; the fields of an
    option group are merged (``{"staging": {"freeze_gc": False}}`` and ``{"staging": {"host_budget_bytes":
    N}}`` give both)."""
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            if k in OPTION_GROUPS and isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = {**out[k], **v}
            else:
                out[k] = dict(v) if k in OPTION_GROUPS and isinstance(v, dict) else v
    return out


def manager_kwargs(kwargs: dict) -> dict:
    """``kwargs`` with each option group given as a dict turned into its checkpointd options object."""
    ckd = require_checkpointd()
    out = {}
    for k, v in kwargs.items():
        if k in OPTION_GROUPS and isinstance(v, dict):
            cls = getattr(ckd, OPTION_GROUPS[k], None)
            if cls is None:
                raise RuntimeError(f"checkpointd has no {OPTION_GROUPS[k]} for the {k!r} options {v!r}")
            v = cls(**v)
        out[k] = v
    return out


def make_manager(root: str, state: dict, *, notes: list[str] | None = None, **kwargs: Any) -> Any:
    """CheckpointManager(root, state, **kwargs), option groups given as dicts (:func:`manager_kwargs`),
    dropping keyword arguments it does not accept (noted)."""
    ckd = require_checkpointd()
    names, var_kw = manager_params()
    use = {}
    for k, v in kwargs.items():
        if k in names or var_kw:
            use[k] = v
        elif notes is not None:
            notes.append(f"CheckpointManager has no argument {k!r}; dropped")
    return ckd.CheckpointManager(root, state, **manager_kwargs(use))


DEVICE_STAGING = {"staging": {"device_budget_bytes": 64 << 30}}
"""The keyword arguments that turn on device staging: a GPU memory budget (64 GiB here)."""


def device_staging_kwargs(explicit: dict | None) -> tuple[dict | None, str]:
    """Keyword arguments that turn on device staging, or (None, why not)."""
    if explicit:
        return explicit, f"device staging via --device-kwargs {json.dumps(explicit)}"
    names, _ = manager_params()
    if "staging" not in names or not hasattr(require_checkpointd(), OPTION_GROUPS["staging"]):
        return None, ("CheckpointManager has no staging=StagingOptions(...) argument; pass --device-kwargs "
                      "'{\"name\": value}' to name the device-staging option")
    budget = DEVICE_STAGING["staging"]["device_budget_bytes"]
    return merge_kwargs(DEVICE_STAGING), f"device staging via staging.device_budget_bytes={budget}"


def safe_stats(mgr: Any) -> dict:
    try:
        return jsonable(mgr.stats())
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)[:200]}


def has_zstd() -> bool:
    try:
        import zstandard  # noqa: F401, PLC0415
        return True
    except Exception:  # noqa: BLE001
        return False


def init_single_rank_group(cuda: bool) -> str:
    """A 1-rank process group (gloo for CPU, plus NCCL on CUDA), for APIs that insist on one."""
    import torch.distributed as dist  # noqa: PLC0415
    if dist.is_initialized():
        return "already initialised"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket  # noqa: PLC0415
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    return f"initialised a 1-rank {backend} group"


# ----------------------------------------------------------------------------------------------------
# files


def clean_dir(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)


def is_memory_fs(fstype: str | None) -> bool:
    """tmpfs and friends: no disk behind the page cache."""
    from checkpointd.storage import fsinfo  # noqa: PLC0415
    return fsinfo.is_memory_backed(fstype)


def fs_type(path: str) -> str:
    """File system type of ``path`` from /proc/mounts (longest matching mount point)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1]
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def free_bytes(path: str) -> int:
    os.makedirs(path, exist_ok=True)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def drop_file_cache(root: str) -> None:
    """Evict the page cache of every file under ``root`` (no-op on tmpfs; needs no root)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for dp, _, fns in os.walk(root):
        for fn in fns:
            try:
                fd = os.open(os.path.join(dp, fn), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def dir_bytes(root: str) -> int:
    tot = 0
    for dp, _, fns in os.walk(root):
        for fn in fns:
            try:
                tot += os.path.getsize(os.path.join(dp, fn))
            except OSError:
                pass
    return tot


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def byte_views(ts: Sequence[torch.Tensor]) -> list[memoryview]:
    """Zero-copy byte views of contiguous CPU tensors."""
    out = []
    for t in ts:
        assert t.device.type == "cpu" and t.is_contiguous()
        out.append(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))
    return out


# ----------------------------------------------------------------------------------------------------
# numbers, tables, JSON


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt(x: Any, spec: str = ".1f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:  # nan
            return "-"
        return format(x, spec)
    return str(x)


def table(rows: list[dict], cols: list[tuple[str, str]], title: str | None = None) -> str:
    """Plain-text table. ``cols``: (key, header). Values are pre-formatted strings or numbers."""
    cells = [[str(r.get(k, "")) for k, _ in cols] for r in rows]
    heads = [h for _, h in cols]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    out = []
    if title:
        out.append(title)
    out.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(heads, widths))))
    out.append("  ".join("-" * w for w in widths))
    for c in cells:
        out.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
    return "\n".join(out)


def jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [jsonable(v) for v in o]
    if isinstance(o, float) and o != o:
        return None
    if isinstance(o, (str, int, float, bool)) or o is None:
        return o
    if torch.is_tensor(o) and o.numel() == 1:
        return o.item()
    return repr(o)


def write_json(path: str | None, obj: dict, *, quiet: bool = False) -> None:
    """Write ``obj`` as JSON (atomically: a killed run leaves the previous complete file)."""
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(obj), f, indent=1)
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}", flush=True)


def parse_json_arg(s: str | None) -> dict:
    if not s:
        return {}
    v = json.loads(s)
    if not isinstance(v, dict):
        raise SystemExit(f"expected a JSON object, got {s!r}")
    return v


def timed(fn: Callable[[], Any], dev: Dev | None = None) -> tuple[float, Any]:
    if dev is not None:
        dev.sync()
    t0 = time.perf_counter()
    r = fn()
    if dev is not None:
        dev.sync()
    return time.perf_counter() - t0, r


@contextlib.contextmanager
def env_set(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables (a library switch a benchmark row compares) and put them back after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def collect() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


# ----------------------------------------------------------------------------------------------------
# raw I/O: the ceiling a checkpoint writer/reader is compared with (same bytes, several threads, fsync)

CHUNK_BYTES = 64 << 20


def split_groups(sizes: Sequence[int], n: int) -> list[list[int]]:
    """Indices split into ``n`` groups of about equal bytes (largest first, greedy), order kept inside."""
    n = max(1, min(n, len(sizes)))
    groups: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += sizes[i]
    return [sorted(g) for g in groups if g]


def _pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, off)
        mv, off = mv[n:], off + n


def _pread_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        n = os.preadv(fd, [mv], off)
        if n <= 0:
            raise EOFError(f"short read at offset {off}")
        mv, off = mv[n:], off + n


def raw_write(root: str, views: Sequence[memoryview], *, nfiles: int, threads: int,
              mmap_mode: bool = False, groups: list[list[int]] | None = None,
              writeback: bool = False, truncate: bool = True) -> tuple[float, list[tuple[str, list[int]]]]:
    """Write ``views`` into ``nfiles`` files with ``threads`` threads (64 MiB pwrite chunks), fsync each.

    ``mmap_mode``: instead of pwrite, ``posix_fallocate`` each file, map it and copy the chunks into the
    mapping from the threads (what checkpointd's writer does on tmpfs). ``groups``: which views go into
    which file (default: ``nfiles`` files of about equal size). ``writeback``: start the disk on each
    chunk once written (``sync_file_range``, what checkpointd's writer does on disks). ``truncate=False``:
    write over files left by an earlier call (pages or blocks that exist, as a recycled checkpoint file).
    Returns the wall time from the first open to the last fsync, and [(file, view indices)] in file order.
    """
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415
    os.makedirs(root, exist_ok=True)
    groups = groups if groups is not None else split_groups([len(v) for v in views], nfiles)
    files = [(os.path.join(root, f"raw{k:03d}.bin"), g) for k, g in enumerate(groups)]
    tasks = []  # (file index, view, offset)
    for fi, (_, g) in enumerate(files):
        off = 0
        for i in g:
            v = views[i]
            for s in range(0, len(v), CHUNK_BYTES):
                tasks.append((fi, v[s:s + CHUNK_BYTES], off + s))
            off += len(v)
    t0 = time.perf_counter()
    fds = [os.open(p, os.O_CREAT | os.O_RDWR | (os.O_TRUNC if truncate else 0), 0o644) for p, _ in files]
    maps: list[Any] = []
    try:
        if mmap_mode:
            import mmap  # noqa: PLC0415
            import numpy as np  # noqa: PLC0415
            for fd, (_, g) in zip(fds, files):
                size = sum(len(views[i]) for i in g)
                if size:
                    os.posix_fallocate(fd, 0, size)
                    maps.append(mmap.mmap(fd, size, access=mmap.ACCESS_WRITE))
                else:
                    maps.append(None)
            dests = [np.frombuffer(m, dtype=np.uint8) if m is not None else None for m in maps]

            def put(t: Any) -> None:
                np.copyto(dests[t[0]][t[2]:t[2] + len(t[1])], np.frombuffer(t[1], dtype=np.uint8))
        else:
            def put(t: Any) -> None:
                _pwrite_all(fds[t[0]], t[1], t[2])
        if writeback:
            from checkpointd.storage import fsinfo  # noqa: PLC0415
            copy = put

            def put(t: Any) -> None:
                copy(t)
                fsinfo.start_writeback(fds[t[0]], t[2], len(t[1]))
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(put, tasks))
            if mmap_mode:
                dests = []
                for m in maps:
                    if m is not None:
                        m.close()
                maps = []
            list(ex.map(os.fsync, fds))
    finally:
        for fd in fds:
            os.close(fd)
    return time.perf_counter() - t0, files


def raw_read(files: Sequence[tuple[str, list[int]]], views: Sequence[memoryview], *, threads: int) -> float:
    """Read files written by :func:`raw_write` back into ``views`` with ``threads`` threads (64 MiB preads)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415
    tasks = []
    for fi, (_, g) in enumerate(files):
        off = 0
        for i in g:
            v = views[i]
            for s in range(0, len(v), CHUNK_BYTES):
                tasks.append((fi, v[s:s + CHUNK_BYTES], off + s))
            off += len(v)
    t0 = time.perf_counter()
    fds = [os.open(p, os.O_RDONLY) for p, _ in files]
    try:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda t: _pread_all(fds[t[0]], t[1], t[2]), tasks))
    finally:
        for fd in fds:
            os.close(fd)
    return time.perf_counter() - t0


def thread_counts(spec: str | None) -> list[int]:
    """'1,8,max' -> [1, 8, os.cpu_count()] (deduplicated, ascending)."""
    ncpu = os.cpu_count() or 1
    out = set()
    for s in (spec or "1,8,max").split(","):
        s = s.strip()
        if s:
            out.add(ncpu if s == "max" else int(s))
    return sorted(out)


def sample_checksums(ts: Sequence[torch.Tensor], every: int = 7) -> list[float]:
    """Float64 sums of every ``every``-th tensor: a cheap check that a restore brought the values back."""
    return [float(t.detach().double().sum()) for t in ts[::every]]
