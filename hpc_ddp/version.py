"""hpc_ddp's version (``hpc_ddp.__version__``), also what a laptop and the cluster's login
node compare before a remote submit (hpc_ddp/remote/submit_remote.py). Keep it equal to
pyproject.toml's."""

VERSION = "0.1.0"
