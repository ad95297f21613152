"""After submission, on the submit host: a run's state, logs, cost and failures, followed,
stopped or cancelled (``python -m hpc_ddp.status`` and ``python -m hpc_ddp.logs`` are the
commands; docs/observability.md)."""
