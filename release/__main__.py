"""``python -m release build|publish|table|card|check|continues``: see :mod:`release.command`."""

import sys

from release.command import main

sys.exit(main())
