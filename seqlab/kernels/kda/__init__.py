"""Mosaic TPU kernels of the chunked KDA (Kimi Delta Attention) scan, forward and backward.

`api.chunked_scan` is the entry point (`seqlab.ops.kda(impl="pallas_tpu")` calls it); the kernel
contract, the algorithm and what was verified are in README.md.
"""
