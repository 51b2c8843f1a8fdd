"""seqlab: sequence models in JAX, with exact oracles, fast kernels and numerically checked theory.

Packages: `seqlab.ops` (pure-JAX ops and their dispatchers), `seqlab.kernels` (Pallas kernels
behind the dispatchers), `seqlab.modules` (Flax linen models), `seqlab.dynamics` (continuous-time
token dynamics), `seqlab.sketching` (randomized embeddings and matrix-product sketches),
`seqlab.analysis` (measurements on models), `seqlab.train` (training plumbing). See DESIGN.md for
the import direction.
"""

__version__ = "0.1.0"
