"""Submission side: resolve the config for a target, prepare the run dir, submit, follow."""
