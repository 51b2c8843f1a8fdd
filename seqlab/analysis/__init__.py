"""Measurements on any model: Jacobian influence (`seqlab.analysis.influence`)."""
