"""``python -m checkpointd.cli ...``: the same command line as ``checkpointd``."""

import sys

from checkpointd.cli import main

if __name__ == "__main__":
    sys.exit(main())
