"""checkpointd under torch.distributed (SPEC §4): coordination, full and sharded modes, resharding.

Modules, in the order a save meets them:

- ``runtime.py``       DistributedRuntime: what the manager consults at its hook points
- ``state_dicts.py``   gather / local state dicts (torch.distributed.checkpoint.state_dict), in-place loading,
                       FSDP1 channels_last optimizer-state fix
- ``statecache.py``    sharded-mode state dicts rebuilt from cached plans instead of the full call per save
- ``coordination.py``  dedicated gloo groups; the commit protocol (rank 0 commits after every rank reports)

Shared with restore and ``checkpointd.load``, and so kept below this package: ``format/sharding.py``
(DTensor local blocks <-> global shape, offsets, placements and mesh records; resharding) and
``restore/assemble.py`` (the sharded step layout; ``assemble_full_values``).
"""

from __future__ import annotations


def is_active() -> bool:
    """True when torch.distributed is initialized in this process (the manager then coordinates ranks)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return False
    return bool(dist.is_available() and dist.is_initialized())


__all__ = ["is_active"]
