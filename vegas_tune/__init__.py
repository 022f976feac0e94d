"""vegas-tune: the auto-tuner that turns Vegas into deployable profiles.

Entry points: the ``vegas-tune`` CLI (``vegas_tune.cli``), ``vegas_tune.profile`` (the
profile schema: load, validate, diff, write) and ``vegas_tune.export``.
"""
