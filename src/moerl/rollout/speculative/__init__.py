"""Speculative decoding for the rollout engine: drafters, exact verification, metrics.

Nothing is imported here, so `speculative.config` costs no torch to read: the
drafters live in `drafters`, verification in `verify`, counters in `metrics`.
"""
