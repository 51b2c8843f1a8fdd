"""Continuous-time dynamics: token vector fields and their integration (`mamba_ode`)."""
