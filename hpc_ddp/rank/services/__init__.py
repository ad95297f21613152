"""The services a training loop uses, ours and yours alike: checkpoints, RNG state, the stop
agreement, the periodic collective, metrics, stacks on request."""
