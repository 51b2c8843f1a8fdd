"""Measurements on any model: Jacobian influence (`influence`), token similarity (`similarity`),
state transitions (`transitions`), weight-product spectra (`spectra`), finite-time Lyapunov
exponents of discretized flows (`lyapunov`), and rate fits of measured curves (`rates`)."""

from seqlab.analysis import lyapunov, rates, spectra
from seqlab.analysis.influence import jacobian_influence, module_influence, token_influence
from seqlab.analysis.similarity import (
    average_pairwise_distance,
    channel_range,
    diameter,
    dirichlet_energy,
    relative_dirichlet_energy,
)
from seqlab.analysis.transitions import transition_range, transitions

__all__ = [
    "average_pairwise_distance",
    "channel_range",
    "diameter",
    "dirichlet_energy",
    "jacobian_influence",
    "lyapunov",
    "module_influence",
    "rates",
    "relative_dirichlet_energy",
    "spectra",
    "token_influence",
    "transition_range",
    "transitions",
]
