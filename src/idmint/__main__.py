"""`python -m idmint`: the same as the `idmint` command."""

import sys

from .cli import main

sys.exit(main())
