"""Runs on a cluster reached over SSH from a laptop or a notebook (docs/remote.md).

``ssh``: the one connection (OpenSSH, multiplexed, never a prompt) and what its failures
mean; ``snapshot``: the project's files packed into a content-addressed copy on the cluster;
``submit_remote``: the laptop's side of ``submit cluster.remote=HOST``; ``handle``: the small
local run dir that stands for the remote run, and ``status``/``logs`` forwarded through it.
"""
