"""Daliri, Freire, Li, Musco (arXiv 2501.17836): matrix product sketching via coordinated sampling,
checked on `seqlab.sketching`."""
