"""The built-in trainer: hpc_ddp's own DDP loop over configured model, data, loss and optimizer."""
