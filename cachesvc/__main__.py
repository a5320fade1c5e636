"""`python -m cachesvc` is the `cachesvc` command."""

import sys

from cachesvc.cli import main

sys.exit(main())
