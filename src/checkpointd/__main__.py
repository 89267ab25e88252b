"""``python -m checkpointd ...``: the same command line as the installed ``checkpointd`` script."""

import sys

from checkpointd.cli import main

if __name__ == "__main__":
    sys.exit(main())
