"""The integrations' frameworks stay optional: importing checkpointd (its API, its CLI, load and export)
imports none of them, and the transformers integration does not import lightning."""

from __future__ import annotations

import json
import subprocess
import sys

OPTIONAL = ("lightning", "pytorch_lightning", "transformers", "accelerate", "safetensors")

PROBE = f"""
import json, sys
def imported():
    return sorted({{m.split('.')[0] for m in sys.modules}} & set({OPTIONAL!r}))
import checkpointd, checkpointd.cli, checkpointd.load, checkpointd.export, checkpointd.integrations
core = imported()
import checkpointd.integrations.transformers
print(json.dumps({{"core": core, "transformers": imported()}}))
"""


def test_optional_frameworks_are_imported_only_by_their_integration():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["core"] == []
    # (the other way round cannot be asked: lightning itself imports transformers when it is installed)
    assert "transformers" in seen["transformers"] and "lightning" not in seen["transformers"]
