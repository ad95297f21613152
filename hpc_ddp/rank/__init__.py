"""What runs on every rank: joining the job, the task, and the services a training loop uses.

The submit side (``hpc_ddp.launch``, ``hpc_ddp.sweep``, ``hpc_ddp.api``) hands a task to the
ranks; nothing in this package imports it back.
"""
