"""seqlab: sequence models in JAX, with exact oracles, fast kernels and numerically checked theory.

Packages: `seqlab.ops` (pure-JAX ops and their dispatchers), `seqlab.modules` (Flax linen models),
`seqlab.analysis` (measurements on models). See DESIGN.md for the import direction.
"""

__version__ = "0.1.0"
