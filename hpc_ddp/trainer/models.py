"""The networks a config names: the built-in ones (the classic tiny CNN, torchvision's ResNets
with a CIFAR stem), any torchvision or timm model by name, or a user's `_target_`.

``null`` (not a config choice; the benchmarks build it) is a model that does almost nothing,
so a step's time is the framework's and the data path's: ``python -m hpc_ddp.bench train``
measures the per-step overhead with it.
"""

from __future__ import annotations

import difflib
from typing import Any

from hpc_ddp.config.schema import ModelConfig
from hpc_ddp.errors import UserError


def build_model(cfg: ModelConfig, image_size: int, num_classes: int | None = None) -> Any:
    """A freshly initialised model (seed torch first): ``num_classes`` is the data's, used
    where the config leaves the classes unset; ``image_size`` shapes the built-in networks."""
    if cfg.target is not None:
        return _from_target(cfg, num_classes)
    return builtin_model(cfg.name or "", cfg.num_classes or num_classes or 10, image_size)


def _from_target(cfg: ModelConfig, num_classes: int | None) -> Any:
    import torch.nn as nn  # deferred: torch; start-up: targets

    from hpc_ddp.targets import TargetError, build

    assert cfg.target is not None
    auto = {"num_classes": num_classes} if num_classes else {}
    model = build("model", cfg.target, cfg.kwargs, auto=auto)
    if not isinstance(model, nn.Module):
        raise TargetError("model._target_", cfg.target, f"returned a {type(model).__name__}, "
                          "not a torch.nn.Module.", "return the network (an nn.Module).")
    return model


def builtin_model(name: str, num_classes: int, image_size: int) -> Any:
    """tiny_cnn, resnet18, resnet50 (and the benchmarks' null model)."""
    import torch.nn as nn  # deferred: torch

    if name == "null":
        # Global average pool and a 3 -> classes linear layer: 40 parameters.
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(3, num_classes))
    if name == "tiny_cnn":
        # The classic example: one 3->16 conv, ReLU, 2x2 max-pool, one linear layer.
        side = image_size // 2
        return nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * side * side, num_classes),
        )
    from torchvision import models  # deferred: torchvision

    factory = {"resnet18": models.resnet18, "resnet50": models.resnet50}[name]
    # weights=None: nothing is downloaded at run time.
    net = factory(weights=None, num_classes=num_classes)
    if image_size <= 64:
        # Small images: a 7x7 stride-2 stem and a max-pool would leave 8x8 maps from 32x32;
        # the usual CIFAR adaptation uses a 3x3 stride-1 stem and drops the pool.
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    return net


def check_classes(cfg: Any, data_classes: int | None) -> int | None:
    """The classes the model predicts: the config's where it says, else the data's. A config
    and data set that disagree are refused (UserError naming both)."""

    m = cfg.model
    given = m.num_classes if m.target is None else m.kwargs.get("num_classes")
    if isinstance(given, int) and data_classes and given != data_classes:
        data = cfg.data.name or cfg.data.target
        raise UserError("model.num_classes", given, f"the data ({data}) has {data_classes} "
                        "classes.", f"set model.num_classes={data_classes}, or null to take "
                        "the data's.")
    return given if isinstance(given, int) else data_classes


def describe_model(cfg: ModelConfig) -> str:
    """"tiny_cnn", "torchvision mobilenet_v3_small", "my_pkg.nets.Net" (for logs)."""
    if cfg.target is None:
        return cfg.name or "?"
    ours = cfg.target.removeprefix(f"{__name__}.")
    if ours != cfg.target:  # torchvision_model -> "torchvision <arch>"
        return f"{ours.removesuffix('_model')} {cfg.kwargs.get('arch')}"
    return cfg.target


def is_conv_net(model: Any) -> bool:
    """Whether channels_last (NHWC) applies: the model has 2-d convolutions."""
    import torch.nn as nn  # deferred: torch

    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def torchvision_model(arch: str, num_classes: int | None = None, **kwargs: Any) -> Any:
    """torchvision.models.get_model(arch), randomly initialised (nothing is downloaded)."""

    from torchvision import models  # deferred: torchvision


    known = models.list_models()
    if arch not in known:
        close = difflib.get_close_matches(arch, known, n=3)
        raise UserError("model.arch", arch, "is not a torchvision model.",
                        (f"did you mean {' or '.join(close)}? " if close else "")
                        + "torchvision.models.list_models() lists them.")
    extra = {"num_classes": num_classes} if num_classes else {}
    return models.get_model(arch, weights=None, **extra, **kwargs)


def timm_model(arch: str, num_classes: int | None = None, **kwargs: Any) -> Any:
    """timm.create_model(arch), randomly initialised; timm is optional (pip install timm)."""

    try:
        import timm  # optional: timm
    except ImportError:
        raise UserError("model", "timm", "needs the timm package, which is not installed.",
                        "pip install timm (on the nodes too), or use model=torchvision.") from None
    if not timm.is_model(arch):
        raise UserError("model.arch", arch, "is not a timm model.",
                        "timm.list_models() lists them (e.g. resnet18, vit_tiny_patch16_224).")
    extra: dict[str, Any] = {"num_classes": num_classes} if num_classes else {}
    return timm.create_model(arch, pretrained=False, **extra, **kwargs)
