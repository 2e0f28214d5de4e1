import sys

from dataquay.server.cli import main

sys.exit(main())
