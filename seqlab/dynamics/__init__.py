"""Continuous-time dynamics: token vector fields and their integration (`mamba_ode`), and
self-attention particle flows on the sphere (`token_flow`)."""
