"""Scoring a policy on benchmarks through a rollout backend: the loop eval.py and
train.py's in-training evaluation both run (loop), sampling and grading a benchmark's
problems, over the ranks where there are several (generate), the scores of its samples
(scores), and the result files that let a re-run skip what is finished (results).
Nothing here loads models or parses flags."""
