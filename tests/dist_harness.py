"""Run a function on N processes under torch.distributed, with a deadline the parent enforces.

Why not ``torch.multiprocessing.spawn``: it waits forever when a child hangs in a collective. Here:

- children come from a ``forkserver`` that imported torch once (a fresh 2-core CI machine pays the
  import cost once per session, not once per rank per test), and never inherit pytest's threads;
- every child gets a free TCP port, short process-group timeouts and writes its result (or its
  traceback) to a file; after ``destroy_process_group`` it leaves with ``os._exit`` so no atexit
  handler or stuck background thread can keep it alive;
- the parent waits until ``deadline_secs``, then kills every child still running and fails with the
  tracebacks it has;
- a child's stderr goes to a file, with ``faulthandler`` on: a rank that dies in C (SIGABRT, SIGSEGV) or
  hangs (the parent sends SIGUSR2 before killing it) is reported with what it printed and every thread's
  stack, where it would otherwise leave only its exit code.

Backend: ``gloo`` on CPU by default; ``CHECKPOINTD_TEST_BACKEND=nccl`` runs the same scenarios on one
GPU per rank (``torch.cuda.set_device(rank)``; tests pick the device with :func:`device`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

_CTX: Any = None


def backend() -> str:
    """``gloo`` (default) or the value of ``CHECKPOINTD_TEST_BACKEND``."""
    return os.environ.get("CHECKPOINTD_TEST_BACKEND", "gloo").strip().lower() or "gloo"


def device() -> Any:
    """The device a rank's tensors live on: ``cuda:<local rank>`` under nccl, else CPU."""
    import torch

    if backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "checkpointd", "torture_worker"]
"""What the session's one forkserver imports once, for every test that forks from it (the ranks here,
the torture's children): the first user starts the server and its list is the one that counts.
torch._dynamo: an optimizer's first step() imports it (~2 s)."""


def forkserver_context() -> Any:
    """The ``forkserver`` context with :data:`FORKSERVER_PRELOAD`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = forkserver_context()
    return _CTX


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, out_dir: str, be: str, args: tuple[Any, ...]) -> None:
    code = 1
    _stderr_to_file(Path(out_dir, f"rank-{rank}.stderr"))
    try:
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        if be == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(be, rank=rank, world_size=world_size, timeout=timedelta(seconds=45))
        try:
            result = fn(rank, world_size, *args)
            payload: dict[str, Any] = {"ok": True, "result": result}
        except BaseException:  # noqa: BLE001 - reported to the parent
            payload = {"ok": False, "error": traceback.format_exc()}
        Path(out_dir, f"rank-{rank}.pkl").write_bytes(pickle.dumps(payload))
        code = 0 if payload["ok"] else 1
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    except BaseException:  # noqa: BLE001 - setup failed
        try:
            Path(out_dir, f"rank-{rank}.pkl").write_bytes(pickle.dumps({"ok": False, "error": traceback.format_exc()}))
        except Exception:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


def _stderr_to_file(path: Path) -> None:
    """Send this child's fd 2 to ``path`` and dump every thread's stack there on a fatal signal.

    A rank that dies in C++ (SIGABRT from a ``std::terminate``, SIGSEGV) leaves no pickled traceback;
    what it printed and faulthandler's stacks are then the only evidence, and the parent quotes them.
    """
    import faulthandler
    import sys

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until os._exit
        faulthandler.enable(file=sys.stderr, all_threads=True)
        faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)  # USR1: checkpointd's preemption signal
    except (OSError, AttributeError, ValueError):
        pass


def _stderr_tail(path: Path, limit: int = 6000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    text = text[-limit:].strip()
    return f"\n  its stderr (last {limit} characters):\n" + "\n".join("    " + line for line in text.splitlines()) if text else ""


class DistributedFailure(AssertionError):
    """A rank raised, exited abnormally, or the deadline passed."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, deadline_secs: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return each rank's result.

    ``fn`` must be a module-level function (children import it). Raises DistributedFailure with every
    failing rank's traceback; kills the children that are still running at the deadline.
    """
    ctx = _context()
    be = backend()
    if be == "nccl":
        import torch

        if world_size > torch.cuda.device_count():
            import pytest

            pytest.skip(f"nccl needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="checkpointd-dist-") as out_dir:
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, out_dir, be, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_secs
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:  # every thread's stack into its stderr file, then kill
            try:
                os.kill(procs[r].pid, signal.SIGUSR2)
            except OSError:
                pass
        if hung:
            time.sleep(1.0)
        for r in hung:
            procs[r].kill()
        for p in procs:
            p.join(5)
        results: list[Any] = []
        errors: list[str] = []
        for r, p in enumerate(procs):
            f = Path(out_dir, f"rank-{r}.pkl")
            if not f.exists():
                why = ("killed at the deadline (the stacks below were dumped then)" if r in hung
                       else f"exited with code {p.exitcode} and no result")
                errors.append(f"rank {r}: {why}{_stderr_tail(Path(out_dir, f'rank-{r}.stderr'))}")
                results.append(None)
                continue
            payload = pickle.loads(f.read_bytes())
            if payload["ok"]:
                results.append(payload["result"])
            else:
                errors.append(f"rank {r} raised:\n{payload['error']}")
                results.append(None)
        if hung:
            errors.insert(0, f"deadline of {deadline_secs:.0f} s passed; ranks {hung} were killed")
        if errors:
            raise DistributedFailure("\n".join(errors))
        return results


# -- helpers the distributed scenarios share (run inside the ranks) ------------------------------------


def world_mesh() -> Any:
    """A 1-D mesh of every rank on :func:`device`'s type.

    Why explicit: ``fully_shard`` without a mesh builds one on CUDA whenever CUDA is available, and
    gloo ranks on a one-GPU host then ask for ``cuda:1`` ("invalid device ordinal")."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device().type, (dist.get_world_size(),))


def fsdp2_with_adamw(model_cls: Callable[[], Any], seed: int) -> tuple[Any, Any]:
    """``model_cls()`` seeded with ``seed`` on this rank's device, its ``a`` submodule and then the whole
    model wrapped with FSDP2 (``fully_shard``), and an AdamW over it."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = model_cls().to(device())
    mesh = world_mesh()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def train_same_batches(model: Any, opt: Any, steps: int, *, seed: int, features: int) -> None:
    """``steps`` optimizer steps on batches drawn from ``seed``: the same batches on every rank."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, features, generator=g).to(next(model.parameters()).device)
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()


def gathered_state(model: Any, opt: Any) -> dict[str, Any]:
    """Gathered model, FQN-keyed optimizer state and param groups (collective), as CPU copies."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    sd = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(model, options=opts).items()}
    osd = get_optimizer_state_dict(model, opt, options=opts)
    state = {k: {n: (t.cpu().clone() if isinstance(t, torch.Tensor) else t) for n, t in st.items()} for k, st in osd["state"].items()}
    groups = [dict(g) for g in osd["param_groups"]]
    return {"model": sd, "state": state, "groups": groups}


def assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit-exact equality of two :func:`gathered_state` results (model and optimizer state)."""
    import torch

    assert sorted(got["model"]) == sorted(want["model"])
    for k, t in want["model"].items():
        assert torch.equal(got["model"][k], t), k
    assert sorted(got["state"]) == sorted(want["state"])
    for k, st in want["state"].items():
        for n, t in st.items():
            assert torch.equal(torch.as_tensor(got["state"][k][n]), torch.as_tensor(t)), (k, n)
