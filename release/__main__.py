"""``python -m release build|publish|table|card``: see :mod:`release.command`."""

import sys

from release.command import main

sys.exit(main())
