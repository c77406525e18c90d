"""`python -m minisparse.bench`: see minisparse/bench/run.py."""
from minisparse.bench.run import main

main()
