"""`megamemo plan`: per-rank memory of a layout (layouts.py), its predicted step time (steptime.py) and the
recommended layouts (recommend.py)."""
