"""``python -m stepskip``: the command line."""

from stepskip.cli import main

raise SystemExit(main())
