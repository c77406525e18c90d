"""What a run's metrics.jsonl shows: its rows read back (metrics), training curves of one
or more runs (curves), and an ablation's results tables (table); eval.py's results
folders side by side (evals).
`python -m minisparse.plot` draws and prints them."""
