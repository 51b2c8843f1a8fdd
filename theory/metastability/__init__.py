"""Bruno, Pasqualotto, Agazzi (arXiv 2410.23228): meta-stable clustering of self-attention
particles, checked on `seqlab.dynamics.token_flow`."""
