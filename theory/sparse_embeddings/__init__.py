"""Silwal, Woodruff, Zhang (arXiv 2502.19865): embeddings of sparse vectors, checked on
`seqlab.sketching`."""
