"""The context a user's own code gets: a function entry's, and a script's through
``hpc_ddp.context()``."""
