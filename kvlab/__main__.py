"""``python -m kvlab``: the command line (``kvlab.cli``)."""

from kvlab.cli import main

raise SystemExit(main())
