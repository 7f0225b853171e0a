"""moe_cutlass: a Mixture-of-Experts layer for NVIDIA Hopper (SM90), MXFP4 weights, BF16 activations."""
