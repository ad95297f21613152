"""A real multi-node Slurm cluster on one machine, for tests.

munged, MariaDB + slurmdbd, slurmctld and one slurmd per node, each node in its own network
namespace with its own address and hostname. Start it with
``python -m hpc_ddp.testcluster up`` (as root) or the ``slurm_cluster`` pytest fixture; see
docs/testcluster.md. The logic lives in :mod:`hpc_ddp.testcluster.cluster`.
"""
