"""`megamemo plan`: per-rank memory of a layout (layouts.py), its predicted step time (steptime.py: the model's op
trace, optrace.py and fused_trace.py, priced by opcost.py on the devices of devices.py), the recommended layouts
(recommend.py) and what the command prints (report.py)."""
