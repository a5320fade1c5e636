"""`python -m cachesvc` is the `cachesvc` command."""

import sys

from cachesvc.commands.cachesvc import main

sys.exit(main())
