"""One rank joining its job: who it is (Slurm's environment), its device, its network, the NCCL
settings, the rendezvous, the software check, the run dir's owner, its log."""
