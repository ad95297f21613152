"""The processes' entry points on every rank: the task submitit (or srun) runs, the function
entry, the supervised child, the script runner, a step's task."""
