"""Linear layers on CPU through oneDNN with weights reordered once into its blocked layout.

`F.linear` hands small-batch float32 matmuls to MKL, which on this class of CPU streams the weights at a
third to a half of the rate oneDNN reaches with a prepacked weight (decode steps are bound by reading the
weights: 540 MB per step for SmolLM2-135M in float32). vLLM's CPU backend prepacks its linears for oneDNN
the same way (`dispatch_cpu_unquantized_gemm` in vllm/model_executor/layers/utils.py). One packing serves
every batch size; the batch-size argument is only a hint for the layout.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("pdserve.cpu")

_LAYOUT_HINT_BATCH = 32


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # A plain attribute, not a parameter: an opaque oneDNN tensor that state_dict() must not carry.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _LAYOUT_HINT_BATCH)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def _supported(dtype: torch.dtype) -> bool:
    if dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:  # a build without the ops (or a CPU oneDNN refuses) keeps F.linear
        probe = PackedLinear(nn.Linear(8, 4))
        with torch.inference_mode():
            got = probe(torch.ones(2, 8))
        return got.shape == (2, 4)
    except (RuntimeError, AttributeError) as e:
        log.warning("oneDNN packed linears unavailable (%s); using F.linear", e)
        return False


def pack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replaces every nn.Linear in `model` by a PackedLinear (float32 CPU models); returns how many.
    A head tied to the embeddings gets a packed copy: the embedding keeps its own weight for lookups."""
    if not _supported(dtype):
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
