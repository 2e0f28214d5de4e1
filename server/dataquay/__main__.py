"""``python -m dataquay``: the ``dataquay`` command, for an environment whose
scripts folder is not on PATH. ``dataquay`` is a namespace shared by the
protos, client and server distributions' folders; this one module is its
only file, shipped with the server's."""

import sys

from dataquay.server.cli import main

sys.exit(main())
