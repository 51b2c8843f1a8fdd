"""Pallas kernels of the chunked gated delta rule: Mosaic TPU and Mosaic GPU (Hopper), forward and
backward.

`api` holds the entry points (`seqlab.ops.gated_delta_rule(impl="pallas_tpu" | "pallas_gpu")` calls
them); the kernel contract, the algorithm and what was verified where are in README.md.
"""
