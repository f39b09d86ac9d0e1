"""``python -m hetero.cli``: the `hetero` command (how the ssh launcher and the tests start it)."""

import sys

from hetero.cli import main

sys.exit(main())
