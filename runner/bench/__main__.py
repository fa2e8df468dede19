"""``python -m runner.bench``: see cli.py."""

from runner.bench.cli import main

raise SystemExit(main())
