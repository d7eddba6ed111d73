"""``python -m gpulazy``: the same as the ``gpulazy`` command."""

from __future__ import annotations

import sys

from gpulazy.cli import main

sys.exit(main())
