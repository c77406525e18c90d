"""Kept for its old command line: the paged decode benchmark is now
`python -m minisparse.engine.bench_decode` (same flags)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minisparse.engine.bench_decode import main  # noqa: E402

if __name__ == "__main__":
    main()
