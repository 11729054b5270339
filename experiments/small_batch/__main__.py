"""``python -m experiments.small_batch``: see :func:`experiments.small_batch.runner.main`."""

import sys

from .runner import main

sys.exit(main())
