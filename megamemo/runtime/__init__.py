"""The process around the model: distributed start-up (dist.py; launcher.py: N local processes, restarts after
failures, whose entry point is megamemo/commands/launch.py), the device, the GPU catalogue and peak rates (device.py,
gpus.py, peak.py), stop signals (signals.py), the run directory and its lock (rundir.py, lock.py), clean exits,
failures and their records (interruptions.py; the Slurm batch script's helper over it is scripts/slurm_failure.py),
the decision by replay of a node-suspect stop (suspect.py: it starts `megamemo replay` as a process), hang detection
(watchdog.py), goodput (goodput.py), quiet ranks (quiet.py), the host allocator (allocator.py), resident-memory marks
(rss.py) and a writable folder for torch's JIT extension builds (extensions.py). Knows nothing of training,
evaluation or export."""
