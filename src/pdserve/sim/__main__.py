"""``python -m pdserve.sim``: see ``pdserve.sim.command``."""

import sys

from pdserve.sim.command import main

sys.exit(main())
