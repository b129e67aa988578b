"""Pallas kernels for jaxaccel: one file per kernel (reference math, Pallas kernels, and a public
registry of implementations that dispatches), and ``registry`` (the registry type, platforms)."""
