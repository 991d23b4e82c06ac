"""``python -m conformance.cli``: what the console script runs (and what a matrix cell runs in an
environment without the script)."""

import sys

from conformance.cli import main

sys.exit(main())
