"""`python -m rollout_recovery.cli`: the same command line as `rollout-recovery`."""

import sys

from rollout_recovery.cli import main

sys.exit(main())
