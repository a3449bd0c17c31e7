"""`python -m omni.cli ...`: the `omni` command without its console script (a Ray job's entrypoint)."""
import sys

from omni.cli.entry import main

sys.exit(main())
