"""`python -m tools.bench`: see `tools/bench/__init__.py`."""

import sys

from tools.bench import main

sys.exit(main())
