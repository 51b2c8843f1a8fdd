"""Measurements on any model: Jacobian influence (`influence`), token similarity (`similarity`),
state transitions (`transitions`)."""
