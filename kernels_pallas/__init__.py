"""Pallas kernels for jaxaccel: per kernel a public file (its registry of implementations, which
dispatches), its reference (``<kernel>_reference``: the plain-XLA math every implementation
keeps), and its kernels by backend (``_mgpu``: Mosaic GPU, imported only when it runs); and
``registry`` (the registry type, platforms)."""
