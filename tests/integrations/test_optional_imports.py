"""The integrations' frameworks stay optional: importing checkpointd (its API, its CLI, load and export)
imports none of them."""

from __future__ import annotations

import subprocess
import sys

OPTIONAL = ("lightning", "pytorch_lightning", "transformers", "accelerate", "safetensors")


def _imported_after(code: str) -> set[str]:
    probe = (f"import sys\n{code}\n"
             f"print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({OPTIONAL!r}))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_importing_checkpointd_imports_no_framework():
    assert _imported_after("import checkpointd, checkpointd.cli, checkpointd.load, checkpointd.export, "
                           "checkpointd.integrations") == set()


def test_the_transformers_integration_does_not_import_lightning():
    # (the other way round cannot be asked: lightning itself imports transformers when it is installed)
    assert "lightning" not in _imported_after("import checkpointd.integrations.transformers")
