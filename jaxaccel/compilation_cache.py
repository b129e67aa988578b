"""JAX's persistent compilation cache as the config's ``compilation_cache`` sets it, so a second
run of the same program recompiles nothing (the CLI and ``bench/job.py`` enable it first).

    compilation_cache.enable(cfg.compilation_cache)    # before anything is compiled
"""
from __future__ import annotations

import os


def folder(setting: str, environ=os.environ) -> str | None:
    """The folder config ``compilation_cache`` names: ``"auto"`` is an already set
    ``$JAX_COMPILATION_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxaccel/jax`` (``~/.cache/...``);
    ``"off"`` is None; anything else is the folder itself."""
    if setting == "off":
        return None
    if setting != "auto":
        return os.path.abspath(os.path.expanduser(setting))
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return environ["JAX_COMPILATION_CACHE_DIR"]
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxaccel", "jax")


def enable(setting: str) -> str | None:
    """Point JAX's persistent compilation cache at ``folder(setting)`` (every
    program cached, however fast it compiled, unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
    says otherwise); ``"off"`` leaves JAX's own settings as they are. Call before anything is
    compiled: JAX reads the setting at its first compilation."""
    import jax
    path = folder(setting)
    if path is not None:
        jax.config.update("jax_compilation_cache_dir", path)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
