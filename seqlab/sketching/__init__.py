"""Randomized embeddings of sparse vectors and matrix-product sketches from a shared seed.

Embeddings (`embeddings.py`, Silwal-Woodruff-Zhang 2502.19865): `birthday_embedding` ->
`SparseMap`, `max_embedding` -> `MaxMap`. Product sketches (`products.py`, Daliri-Freire-Li-Musco
2501.17836): `priority_sketch`, `threshold_sketch` -> `RowSketch`; `jl_sketch`, `countsketch` ->
`LinearSketch`; `estimate_product`, `storage`. Target dimensions with their constants:
`dimensions.py`. Sparse inputs: `SparseVectors` (`sparse.py`). Images kept sparse and the sparse
JL transform (`compact.py`): `compact_image`, `compact_max_image`, `sparse_jl` -> `SparseJL`.
Compressed sensing, the decoding baseline of the embeddings paper (`recovery.py`):
`gaussian_measurements`, `measure`, `omp`, `basis_pursuit`.
"""

from seqlab.sketching.compact import SparseJL, compact_image, compact_max_image, sparse_jl
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
from seqlab.sketching.recovery import basis_pursuit, gaussian_measurements, measure, omp
from seqlab.sketching.sparse import SparseVectors, from_dense, sparse_vectors, to_dense

__all__ = [
    "LinearSketch",
    "MaxMap",
    "RowSketch",
    "SparseJL",
    "SparseMap",
    "SparseVectors",
    "basis_pursuit",
    "birthday_dimension",
    "birthday_embedding",
    "collision_bound",
    "compact_image",
    "compact_max_image",
    "countsketch",
    "estimate_product",
    "from_dense",
    "gaussian_measurements",
    "jl_sketch",
    "linf_dimension",
    "lp_distance",
    "max_embedding",
    "max_embedding_dimension",
    "measure",
    "omp",
    "priority_sketch",
    "product_sketch_rows",
    "sparse_jl",
    "sparse_vectors",
    "storage",
    "threshold_sketch",
    "to_dense",
]
