"""`python -m minisparse.engine.bench`: see minisparse/engine/bench/run.py."""
from minisparse.engine.bench.run import main

main()
