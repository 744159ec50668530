"""shardfit: how much memory a training step needs, and the cheapest configuration that fits.

The analytic path (spec, estimate, fit, emit, doctor) never imports torch. The measuring API
(`shardfit.profile`) imports it lazily, on first use.
"""
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import shardfit` stays torch-free for plan/fit/emit.
    if name == "profile":
        from shardfit.measure.api import profile

        return profile
    raise AttributeError(name)
