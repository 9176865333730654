"""Linear methods: how a :class:`~widellm.layers.linear.Linear` holds its weight and computes
``x W^T + b``. The model code builds every linear once, as a ``Linear``; the loader gives each
one a method at load time (:func:`~widellm.layers.linear.assign_linear_methods`), so the same
layer code runs with plain, oneDNN-packed or FP8 block-quantized weights.

A method's lifecycle on one layer:

1. ``create_weights(layer)``: before the checkpoint is read, replace the layer's parameters with
   the ones the checkpoint holds in this format (FP8: a float8 ``weight`` and a
   ``weight_scale_inv``); the plain method keeps ``nn.Linear``'s own.
2. the loader copies the checkpoint's tensors into those parameters;
3. ``process_weights_after_loading(layer)``: turn them into the layout ``apply`` computes on
   (oneDNN: reorder into its blocked layout and drop the plain weight);
4. ``apply(layer, x)``: every forward.

``dense_weight(layer)`` gives load-time hooks (MLA's absorbed matrices) the layer's real weight
in the model dtype whatever the method, before step 3.

Methods are stateless apart from their settings, one instance per layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(ABC):
    """How one linear layer stores its weight and computes ``x W^T + b``."""

    name: ClassVar[str]

    def create_weights(self, layer: nn.Linear) -> None:
        """Give ``layer`` the parameters the checkpoint fills (default: ``nn.Linear``'s)."""

    def process_weights_after_loading(self, layer: nn.Linear) -> None:
        """Convert the loaded parameters into the layout :meth:`apply` reads (default: none)."""

    @abstractmethod
    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., in_features]`` -> ``[..., out_features]`` in x's dtype."""

    def dense_weight(self, layer: nn.Linear) -> torch.Tensor:
        """The layer's weight as a plain ``[out, in]`` tensor of the model dtype (valid before
        :meth:`process_weights_after_loading`)."""
        return layer.weight.detach()


class PlainLinearMethod(LinearMethod):
    """``F.linear`` on the plain weight: the reference every other method is tested against."""

    name = "plain"

    def apply(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)
