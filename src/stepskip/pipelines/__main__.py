"""``python -m stepskip.pipelines``: the same as ``stepskip demo``."""

from stepskip.pipelines.demo import main

raise SystemExit(main())
