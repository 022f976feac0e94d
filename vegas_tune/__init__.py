"""vegas-tune: the three-step auto-tuner that turns Vegas into deployable profiles.

The tuner itself is not built yet; the engine it drives is ``vegas_core``.
"""
