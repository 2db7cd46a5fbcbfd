"""evals: scoring a model on multiple-choice task files (lm_tasks.py), as lm-evaluation-harness scores them;
used by the trainer (--eval_tasks) and by eval_lm.py."""
