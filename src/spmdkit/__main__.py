"""``python -m spmdkit``: the ``spmdkit`` command, for environments without its script on PATH."""

from spmdkit._cli import main

raise SystemExit(main())
