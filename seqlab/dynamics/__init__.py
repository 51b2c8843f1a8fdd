"""Continuous-time dynamics: token vector fields and their integration (`mamba_ode`), and
self-attention particle flows on the sphere (`token_flow`).

The two modules share names (`vector_field`, `integrate`, `Trajectory`), so they are imported as
modules: `from seqlab.dynamics import mamba_ode, token_flow`.
"""

from seqlab.dynamics import mamba_ode, token_flow

__all__ = ["mamba_ode", "token_flow"]
