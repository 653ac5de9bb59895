"""moerl: reinforcement-learning post-training of MoE language models on Megatron-Core."""

__version__ = "0.1.0"
