"""What the tests share (tests only, never shipped): imported as `helpers.X`, tests/ being on sys.path (pytest puts
the folder of tests/conftest.py there; a script that wants these adds it itself, as bench/data_stream.py does).

Data: fixture_data (paths of tests/fixtures), shards (enwik8 shard directories by size, the session's caches of
them), eval_fixtures (tiny checkpoints and word shards for eval, generate and analyze), tiny (tiny models and their
configs), spec_oracle (the spec restated query by query).
Processes: env (the environment of a `megamemo` subprocess), fake_bin (stand-in programs on PATH that record how
they were called), forked and warm_imports (ranks forked from a warm server), distributed (a function on N gloo
ranks), runs_cache (training runs and the session's reference runs), local_launch (jobs under launch/local.sh),
kernel_paths (the model's two execution paths), loopback, loopback_s3, loopback_gcs (object-storage servers).
Checks: errors (the one-line error a bad input must end in).
Programs run by path: sync_sites.py (also imported: its list of needed syncs) and hf_without_megamemo.py.
"""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[1]
