"""``python -m autofit`` runs the command line."""

import sys

from autofit.cli import main

sys.exit(main())
