"""One compression rule per file: NAME.py defines one ScoringRule subclass and is what
`compress.algorithm: NAME` (eval.py --compress NAME) picks. See docs/compression.md,
"Write your own rule"."""
