"""Layer 0: small helpers every other layer may use. They import nothing of megamemo (torch and numpy only where a
function needs them, imported inside it), and megamemo.data may import them: progress.py (progress lines), files.py (the one atomic write, fsync where
durable, and the one sha256), units.py (bpc, ppl, bits per byte), precision.py (the precision names, dtypes and sizes), seeding.py (the default random
streams)."""
