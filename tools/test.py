"""`python -m tools.test`: the README's and `.ci/run`'s test command, kept at this path.

The runner (the suite in phases and lanes, every flag) is `tools/testing/runner.py`;
`python -m tools.test --help` lists its flags, docs/testing.md describes them.
"""

from __future__ import annotations

import sys

from tools.testing.runner import main

if __name__ == "__main__":
    sys.exit(main())
