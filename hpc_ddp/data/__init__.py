"""Data sets (synthetic, cifar10, image_folder, a user's factory), the resumable distributed
sampler and the loaders."""
