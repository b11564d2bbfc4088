"""Triton kernels of GEMM2+GatherRS, each beside its pure-torch reference.

Installed as `megatron_overlap.kernels`. Imports torch and triton only, never Megatron;
nothing runs at import.
"""
