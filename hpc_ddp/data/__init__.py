"""Data sets (synthetic, cifar10, image_folder, shards, a user's factory), the resumable
distributed sampler, the loaders, node-local staging (staging.py, stage_node.py) and packing
shards (pack.py); docs/data.md."""
