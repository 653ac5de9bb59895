"""Sizing a run before it starts: memory and step-time models, the layout search,
the rollout-engine fit, and the figures of the shipped recipes."""
