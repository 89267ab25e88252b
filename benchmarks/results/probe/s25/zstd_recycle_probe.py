"""How many zstd saves write over retired files: retirement budget exactly the committed bytes vs 1.1x."""
import shutil, sys, torch
from checkpointd import CheckpointManager, recycle
torch.manual_seed(0)
for slack in (1.0, 1.1):
    recycle.RETIRE_SLACK = slack
    root = f"/tmp/zrp-{slack}"
    shutil.rmtree(root, ignore_errors=True)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2560), torch.nn.Linear(2560, 2048))
    opt = torch.optim.AdamW(model.parameters())
    got = []
    with CheckpointManager(root, {"model": model, "optim": opt}, every_n_steps=1, keep_last=1, compression="zstd") as mgr:
        for step in range(10):
            model(torch.randn(8, 2048)).square().mean().backward()
            opt.step(); opt.zero_grad()
            mgr.maybe_save(step); mgr.wait()
            ls = mgr.stats()["last_save"]
            got.append(f"{ls['files_recycled']}/{ls['files']}")
    print(f"RETIRE_SLACK={slack}: files recycled per save: {' '.join(got)}", flush=True)
