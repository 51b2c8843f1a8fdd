"""Measurements on any model: Jacobian influence (`influence`), token similarity (`similarity`),
state transitions (`transitions`), weight-product spectra (`spectra`), finite-time Lyapunov
exponents of discretized flows (`lyapunov`)."""
