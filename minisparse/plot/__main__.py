"""`python -m minisparse.plot`: see minisparse/plot/curves.py."""
from minisparse.plot.curves import main

raise SystemExit(main())
