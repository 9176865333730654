"""Names of the tensor-form collectives that work on every torch this project supports."""

from __future__ import annotations

import torch.distributed as dist

# torch 2.13 renamed the tensor forms of these collectives and warns on the old names, which
# older releases still need.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
