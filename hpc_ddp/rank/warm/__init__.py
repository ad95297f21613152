"""Warm starts: one process per node imports torch and the rank program once (server.py); every
rank process of that node (a task, a supervisor's training process) is forked from it
(client.py, thin.py, spawn.py) and made the process a fresh interpreter would have been
(forked.py). docs/performance.md#warm-starts."""
