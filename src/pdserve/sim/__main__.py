"""``python -m pdserve.sim``: see ``pdserve.sim.cli``."""

import sys

from pdserve.sim.cli import main

sys.exit(main())
