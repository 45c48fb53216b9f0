"""`python -m idmint.cli`: the same as the `idmint` command (and `python -m idmint`)."""

import sys

from . import main

sys.exit(main())
