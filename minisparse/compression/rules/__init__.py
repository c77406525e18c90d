"""The shipped compression rules, one per file: NAME.py defines one ScoringRule subclass
and is what `compress.algorithm: NAME` (eval.py --compress NAME) picks. A rule of your own
lives in your own module (module.path:ClassName): docs/compression.md, "Write your own
rule"."""
