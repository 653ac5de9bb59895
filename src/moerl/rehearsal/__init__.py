"""Every distinct rank of a run built at its real size on tensors that hold no memory.

`moerl rehearse` (launchers/rehearse.py) composes a recipe's run; this package builds
each distinct trainer rank (policy, reference, critic, Megatron's gradient buffers and
distributed optimizer state) and rollout rank (serving weights, the KV cache the
engine allocates) through the run's own builders, in a fake process group of the
job's world size, counts the bytes per term and sets them beside the planner's.
"""
