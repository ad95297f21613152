"""What hpc_ddp asks of Slurm, in one place: job states (squeue, sacct), why a job pends,
whether a job fits the partitions (sinfo), what sbatch's refusals mean, whether a controller
answers; and, from a rank, requeue and the relay out of a container. One call per job or
per refresh, never per rank or per point."""
