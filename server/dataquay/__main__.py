"""``python -m dataquay``: the ``dataquay`` command, for an environment whose
scripts folder is not on PATH."""

import sys

from dataquay.server.cli import main

sys.exit(main())
