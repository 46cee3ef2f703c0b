"""The checkpoint format, layout-free: pieces of global tensors (pieces.py) and their merged index (index.py), the
state registry of stateful objects (state.py), the host buffers a snapshot is copied into (staging.py), the sharded
store with its retention (store.py) and commit protocol (commit.py), the single-device format (single.py), the
conversion probe's replay and its bf16/fp16 bound (probe_replay.py, probe_bound.py), the records a checkpoint
keeps of its run (layout.py: where each rank sits; replicas.py: the replica check that let it be written) and fault
points for the crash tests (faults.py). Knows nothing of training or of the run around it."""
