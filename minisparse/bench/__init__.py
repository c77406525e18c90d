"""Benchmarks of the rollout engine, apart from its runtime path: tokens/s against SGLang
and the memory bound (`python -m minisparse.bench`), and the paged decode kernel
alone (`python -m minisparse.bench.decode`)."""
