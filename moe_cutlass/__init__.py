"""moe_cutlass: a Mixture-of-Experts layer for NVIDIA Hopper (SM90) with MXFP4 expert weights
and BF16 activations, built on CUTLASS grouped GEMMs.

Import works without a GPU: the MXFP4 helpers, `prepare_experts`, `select_experts` and the
float32 `reference` layer run on the CPU (and so does `MoELayer`, through the reference);
`fused_moe` needs an SM90 GPU and the built library (`python -m codegen --arch sm90`).
"""
__version__ = "0.1.0"   # the one place it is written: pyproject.toml reads it

from . import reference, tuning
from .experts import PreparedExperts, prepare_experts, stack_experts
from .layer import fused_moe
from .module import MoELayer
from .mxfp4 import dequantize_mxfp4, quantize_mxfp4
from .routing import select_experts
from .workspace import Workspace, allocate_workspace, free_workspaces, workspace_size

__all__ = [
    "MoELayer",
    "PreparedExperts",
    "Workspace",
    "__version__",
    "allocate_workspace",
    "dequantize_mxfp4",
    "free_workspaces",
    "fused_moe",
    "prepare_experts",
    "quantize_mxfp4",
    "reference",
    "select_experts",
    "stack_experts",
    "tuning",
    "workspace_size",
]
