"""`python -m zoo.cli`: the `zoo` command, as launchers start it on each rank."""

import sys

from . import main

sys.exit(main())
