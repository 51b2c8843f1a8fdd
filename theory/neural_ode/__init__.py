"""Tong et al. (arXiv 2503.01329): spectra along depth, Lyapunov exponents and step-count transfer
of neural ODE transformers, checked on small trained seqlab `ODETransformer`s."""
