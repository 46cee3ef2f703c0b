"""Parallel forms of the single-device model: tensor parallelism (megatron-core layers) and pipeline stages."""
