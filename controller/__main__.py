"""``python -m controller``: the ``kvctl`` command."""

import sys

from controller.cli.main import main

sys.exit(main())
