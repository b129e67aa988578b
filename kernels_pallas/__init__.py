"""Pallas kernels for jaxaccel: one file per kernel (reference math, Pallas kernels, dispatch)."""
