"""Datasets (synthetic, cifar10), the resumable distributed sampler and the loaders."""
