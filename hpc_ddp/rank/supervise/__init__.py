"""Supervision and outcome: a process per rank that outlives the training process, and what
is done with how a rank's program ended (summary, stop, failure, requeue)."""
