"""``python -m autospec.cli``: the ``autospec`` command."""

import sys

from autospec.cli import main

sys.exit(main())
