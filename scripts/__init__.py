"""Command-line tools beside train.py and eval.py: benchmarks, soak tests, tables of runs.
Each runs from the repository root as a module, `python -m scripts.NAME`, so it imports
minisparse (and train.py) as the two commands do, without editing sys.path."""
