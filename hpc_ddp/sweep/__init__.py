"""Sweeps: Hydra multirun expanded into points, submitted as Slurm job arrays (or locally)."""
