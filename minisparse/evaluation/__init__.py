"""Scoring a policy on benchmarks through a rollout backend, in the pieces eval.py's loop
runs (train.py's in-training evaluation runs the same loop): sampling and grading a
benchmark's problems, over the ranks where there are several (generate), the scores of
its samples (scores), and the result files that let a re-run skip what is finished
(results). Nothing here loads models or parses flags."""
