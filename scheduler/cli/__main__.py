"""``python -m scheduler.cli``: ``pdlife`` without the entry point."""

import sys

from scheduler.cli.main import main

sys.exit(main())
