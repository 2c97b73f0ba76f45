"""``python -m pagedtrace``."""

import sys

from pagedtrace.cli import main

sys.exit(main())
