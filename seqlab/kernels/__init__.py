"""Pallas kernels, one package per op; the oracles live in `seqlab.ops`."""
