"""Training on a Megatron-Core model: optimizer, one step over a pipeline schedule, LM runs."""
