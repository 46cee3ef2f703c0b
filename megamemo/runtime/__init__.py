"""The process around the model: distributed start-up (dist.py, launcher.py: restarts after failures), the device
and its peak rates (device.py, peak.py), stop signals (signals.py), the run directory and its lock (rundir.py,
lock.py), clean exits, failures and their records (interruptions.py), the decision by replay of a node-suspect stop
(suspect.py), hang detection (watchdog.py), goodput (goodput.py), quiet ranks (quiet.py), the host allocator
(allocator.py), resident-memory marks (rss.py) and a writable folder for torch's JIT extension builds
(extensions.py). Knows nothing of training, evaluation or export (suspect.py starts `megamemo replay` as a process)."""
