"""The parts of `moerl.checkpoint`: config and fingerprints, the manifest, RNG
states, the sharded model and optimizer state, and the directory protocol."""
