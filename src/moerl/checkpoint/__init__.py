"""The parts of `moerl.checkpoint.checkpointer`: config and fingerprints, the manifest, RNG
states, the sharded model and optimizer state, and the directory protocol."""
