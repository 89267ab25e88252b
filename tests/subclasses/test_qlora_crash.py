"""A QLoRA run (frozen NF4 bases, LoRA adapters, AdamW) SIGKILLed mid-run resumes bit-exactly.

The child trains with a checkpoint every 2 steps, is killed once step 6 is committed (step 7 trained,
not saved); a fresh process restores step 6 with ``restore_latest()`` and trains to step 10. Its
LoRA weights, AdamW state and NF4 inner tensors equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.subclasses.quantized_models import assert_bit_equal, optimizer_bits, qlora_model, run_qlora

WORKER = Path(__file__).with_name("qlora_worker.py")


def test_qlora_killed_after_a_commit_resumes_bit_exactly(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "final.pt"
    log = tmp_path / "child.log"
    with log.open("w") as sink:
        child = subprocess.Popen([sys.executable, str(WORKER), str(root), str(out), "10", "6"], stdout=sink, stderr=sink)
    try:
        model = qlora_model(0)  # the uninterrupted run, meanwhile
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        run_qlora(model, opt, range(10))
        deadline = time.monotonic() + 120
        while "stalled after step 7" not in log.read_text():
            assert child.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the child did not reach step 7"
            time.sleep(0.05)
        assert (root / "step-000000006" / "COMMITTED").exists()
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL and not out.exists()

    resumed = subprocess.run([sys.executable, str(WORKER), str(root), str(out), "10"], capture_output=True, text=True,
                             timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert_bit_equal(model.state_dict(), got["model"])
    assert_bit_equal(optimizer_bits(opt), {f"{pid}.{k}": v for pid, st in got["opt"]["state"].items() for k, v in st.items()})
    assert sorted(int(p.parent.name.split("-")[1]) for p in root.glob("step-*/COMMITTED")) == [6, 8, 10]
