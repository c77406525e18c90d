"""The tasks: training datasets (JSONL or generated arithmetic), the evaluation
benchmarks' readers, and the grader that turns a response and its label into a reward."""
