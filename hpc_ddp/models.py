"""The networks a config names: the classic tiny CNN and torchvision's ResNets.

``null`` (not a config choice; the benchmarks build it) is a model that does almost nothing,
so a step's time is the framework's and the data path's: ``python -m hpc_ddp.bench train``
measures the per-step overhead with it.
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.config.schema import ModelConfig


def build_model(cfg: ModelConfig, image_size: int) -> Any:
    """A freshly initialised model for ``image_size`` pixel images (seed torch first)."""
    import torch.nn as nn

    if cfg.name == "null":
        # Global average pool and a 3 -> classes linear layer: 40 parameters.
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(3, cfg.num_classes))
    if cfg.name == "tiny_cnn":
        # The classic example: one 3->16 conv, ReLU, 2x2 max-pool, one linear layer.
        side = image_size // 2
        return nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * side * side, cfg.num_classes),
        )
    from torchvision import models

    factory = {"resnet18": models.resnet18, "resnet50": models.resnet50}[cfg.name]
    # weights=None: nothing is downloaded at run time.
    net = factory(weights=None, num_classes=cfg.num_classes)
    if image_size <= 64:
        # Small images: a 7x7 stride-2 stem and a max-pool would leave 8x8 maps from 32x32;
        # the usual CIFAR adaptation uses a 3x3 stride-1 stem and drops the pool.
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    return net


def is_conv_net(cfg: ModelConfig) -> bool:
    """Whether channels_last (NHWC) applies: the model's work is 2-d convolutions."""
    return cfg.name in ("tiny_cnn", "resnet18", "resnet50")
