"""Sharded saves from cached state-dict plans write exactly what the full path writes.

Two managers save the same live state into two roots at every step: one with the caches of
``distributed/statecache.py`` and ``split_tree``, one with them switched off. (Not with
``statecache.VERIFY_PLANS``: its extra full call would run the state-dict pre-hooks and so hide a
cached path that forgot to.) Between saves the
run changes what a cache must notice: lr by a scheduler, non-tensor optimizer state, a new param group
(state for new parameters), a module restructured, a state-dict pre-hook that writes a buffer. Every
data file must be byte-identical and the manifests equal (but for the time); the hit/miss pattern shows
the cache was used where it may be and dropped where it must be.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from dist_harness import device, run_distributed, world_mesh

import checkpointd
from checkpointd import CheckpointManager, DistributedOptions


class Net(nn.Module):
    """Three FSDP2 layers under the optimizer, one (``extra``) that joins it later, a hook-written buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
        self.extra = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(2))
        self.steps_done = 0
        self.register_state_dict_pre_hook(_write_seen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.layers(x))


def _write_seen(m: nn.Module, prefix: str, keep_vars: bool) -> None:
    m.seen.fill_(float(m.steps_done))  # a pre-hook with an effect: the cached path must run it too


def _post_hook(m: nn.Module, sd: Any, prefix: str, local_metadata: Any) -> None:
    return None  # any post-hook makes a module ineligible for the cache


def _build() -> tuple[nn.Module, torch.optim.Optimizer, Any, nn.Module]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net().to(device())
    mesh = world_mesh()
    for layer in [*net.layers, net.extra]:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.layers.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    head = nn.Linear(4, 2).to(device())
    head.register_state_dict_post_hook(_post_hook)
    return net, opt, sched, head


def _train(net: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    net(torch.randn(4, 8, generator=g).to(device())).sum().backward()
    opt.step()
    opt.zero_grad()


def cached_vs_full(rank: int, world: int, root_a: str, root_b: str) -> Any:
    net, opt, sched, head = _build()
    state = {"model": net, "optim": opt, "sched": sched, "head": head}
    kw = dict(mode="sharded", compression=None, keep_last=None, distributed=DistributedOptions(timeout_secs=30))
    a = CheckpointManager(root_a, state, **kw)
    b = CheckpointManager(root_b, state, **kw)
    b._dist.local_states.enabled = False  # the full path, every save
    g = torch.Generator().manual_seed(rank)
    hits: list[dict[str, int]] = []  # per save: did the save itself use the cache (1) or the full path (0)
    counts = a._dist.local_states.counts

    def save(step: int) -> None:
        before = {k: v[0] for k, v in counts.items()}
        a.save(step)
        hits.append({k: v[0] - before.get(k, 0) for k, v in counts.items()})
        b.save(step)
        a.wait()
        b.wait()

    _train(net, opt, g)
    save(1)                                   # plans learned ahead (after the first optimizer step)
    sched.step()
    net.steps_done = 2
    _train(net, opt, g)
    save(2)                                   # lr changed by the scheduler
    first = next(iter(opt.state))
    opt.state[first]["note"] = "three"
    net.steps_done = 3
    save(3)                                   # non-tensor optimizer state
    opt.add_param_group({"params": list(net.extra.parameters()), "lr": 0.001})
    _train(net, opt, g)                       # new group, state for new parameters: the plan is re-learned
    save(4)                                   # (by the optimizer-step hook that prepares staging buffers)
    _train(net, opt, g)
    save(5)
    net.layers[0].register_buffer("late", torch.full((3,), float(rank)))
    save(6)                                   # module restructured: both plans dropped
    _train(net, opt, g)
    opt.state[first]["note"] = "seven"
    save(7)
    a.close()
    b.close()
    return hits, {k: list(v) for k, v in counts.items()}


def _compare_roots(root_a: Path, root_b: Path) -> list[str]:
    problems = []
    steps = sorted(p.name for p in root_a.iterdir() if p.name.startswith("step-"))
    assert steps == sorted(p.name for p in root_b.iterdir() if p.name.startswith("step-")) and len(steps) == 7
    for step in steps:
        files_a = sorted(str(p.relative_to(root_a / step)) for p in (root_a / step).rglob("*") if p.is_file())
        files_b = sorted(str(p.relative_to(root_b / step)) for p in (root_b / step).rglob("*") if p.is_file())
        if files_a != files_b:
            problems.append(f"{step}: files {files_a} vs {files_b}")
            continue
        for rel in files_a:
            if rel == "COMMITTED":
                continue  # holds the manifest's checksum: the manifests differ in their time
            da, db = (root_a / step / rel).read_bytes(), (root_b / step / rel).read_bytes()
            if rel == "manifest.json":
                ma, mb = json.loads(da), json.loads(db)
                ma.pop("time"), mb.pop("time")
                if ma != mb:
                    problems.append(f"{step}: manifests differ")
            elif da != db:
                problems.append(f"{step}/{rel}: bytes differ")
    return problems


def test_cached_sharded_saves_write_the_same_files(tmp_path: Path) -> None:
    root_a, root_b = tmp_path / "cached", tmp_path / "full"
    results = run_distributed(cached_vs_full, 2, str(root_a), str(root_b), deadline_secs=120)
    assert _compare_roots(root_a, root_b) == []
    for hits, counts in results:
        for name in ("model", "optim"):  # save 6: the module was restructured, both plans dropped
            assert [h[name] for h in hits] == [1, 1, 1, 1, 1, 0, 1], (name, hits)
        assert counts["optim"][1] >= 3  # learned after the first step, after the new group, after save 6
        assert counts["head"][0] == 0  # a module with a state-dict post-hook is never cached
    lrs = [checkpointd.load(str(root_a), step=s)["optim"]["param_groups"][0]["lr"] for s in (1, 2)]
    assert lrs == [0.01, 0.005]
    data = checkpointd.load(str(root_a), step=7)
    assert data["model"]["seen"].tolist() == [3.0, 3.0]
    assert [v.get("note") for v in data["optim"]["state"].values()][0] == "seven"
    assert len(data["optim"]["param_groups"]) == 2 and data["model"]["layers.0.late"].tolist() == [0.0] * 3


def prepared_ahead(rank: int, world: int, root: str) -> Any:
    import time

    net, opt, _sched, _head = _build()
    g = torch.Generator().manual_seed(rank)
    with CheckpointManager(root, {"model": net, "optim": opt}, mode="sharded", compression=None,
                           distributed=DistributedOptions(timeout_secs=30)) as mgr:
        before_step = mgr.stats()["staging_allocations"]  # no optimizer state yet: nothing to prepare
        _train(net, opt, g)  # the optimizer-step hook prepares staging buffers in the background
        deadline = time.monotonic() + 20
        while mgr.stats()["staging_allocations"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        prepared = mgr.stats()["staging_allocations"]
        mgr.save(1)
        after_first = mgr.stats()["staging_allocations"]
        _train(net, opt, g)
        mgr.save(2)
        after_second = mgr.stats()["staging_allocations"]
    return before_step, prepared, after_first, after_second


def test_sharded_mode_prepares_staging_buffers_ahead(tmp_path: Path) -> None:
    for before_step, prepared, after_first, after_second in run_distributed(prepared_ahead, 2, str(tmp_path), deadline_secs=60):
        assert before_step == 0
        assert prepared == after_first == after_second == 1  # the first save found its buffers ready
