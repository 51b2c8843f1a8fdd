"""Wang et al. (arXiv 2501.00658): recency and polarization, checked on the seqlab Mamba."""
