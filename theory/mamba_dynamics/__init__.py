"""Vo et al. (arXiv 2410.03292): token dynamics of selective SSMs, checked on the seqlab Mamba."""
