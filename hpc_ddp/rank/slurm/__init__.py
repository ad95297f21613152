"""Slurm's commands from a rank: requeue and the relay out of a container."""
