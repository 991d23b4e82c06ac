"""``python -m mutation``: the campaign's command line (``mutation.cli``)."""

from __future__ import annotations

import sys

from mutation.cli import main

sys.exit(main())
