"""A run's inputs, checked where they are given: on the submit host (submit, the API, sweeps)
and again on every task of an sbatch job (python -m hpc_ddp.train): the command line, the run
dir, whether a run can be resumed."""
