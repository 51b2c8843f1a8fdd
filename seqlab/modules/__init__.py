"""Flax linen modules: own parameters and initialization, call `seqlab.ops`; no new math here."""
