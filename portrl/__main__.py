"""``python -m portrl ...``: the ``portrl`` command, for an interpreter whose scripts folder is not on PATH."""

import sys

from portrl.cli import main

sys.exit(main())
