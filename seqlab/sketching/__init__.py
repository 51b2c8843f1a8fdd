"""Randomized embeddings of sparse vectors and matrix-product sketches from a shared seed.

Embeddings (`embeddings.py`, Silwal-Woodruff-Zhang 2502.19865): `birthday_embedding` ->
`SparseMap`, `max_embedding` -> `MaxMap`. Product sketches (`products.py`, Daliri-Freire-Li-Musco
2501.17836): `priority_sketch`, `threshold_sketch` -> `RowSketch`; `jl_sketch`, `countsketch` ->
`LinearSketch`; `estimate_product`, `storage`. Target dimensions with their constants:
`dimensions.py`. Sparse inputs: `SparseVectors` (`sparse.py`).
"""

from seqlab.sketching.dimensions import (
    birthday_dimension,
    collision_bound,
    linf_dimension,
    max_embedding_dimension,
    product_sketch_rows,
)
from seqlab.sketching.embeddings import (
    MaxMap,
    SparseMap,
    birthday_embedding,
    lp_distance,
    max_embedding,
)
from seqlab.sketching.products import (
    LinearSketch,
    RowSketch,
    countsketch,
    estimate_product,
    jl_sketch,
    priority_sketch,
    storage,
    threshold_sketch,
)
from seqlab.sketching.sparse import SparseVectors, from_dense, sparse_vectors, to_dense

__all__ = [
    "LinearSketch",
    "MaxMap",
    "RowSketch",
    "SparseMap",
    "SparseVectors",
    "birthday_dimension",
    "birthday_embedding",
    "collision_bound",
    "countsketch",
    "estimate_product",
    "from_dense",
    "jl_sketch",
    "linf_dimension",
    "lp_distance",
    "max_embedding",
    "max_embedding_dimension",
    "priority_sketch",
    "product_sketch_rows",
    "sparse_vectors",
    "storage",
    "threshold_sketch",
    "to_dense",
]
