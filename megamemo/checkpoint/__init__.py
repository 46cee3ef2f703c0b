"""The checkpoint format, layout-free: pieces of global tensors (pieces.py), the state registry of stateful objects
(state.py), the sharded store with its commit protocol and retention (store.py), the single-device format
(single.py), the conversion probe's replay (probe_replay.py) and fault points for the crash tests (faults.py).
Knows nothing of training or of the run around it."""
