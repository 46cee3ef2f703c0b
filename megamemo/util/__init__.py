"""Layer 0: small helpers every other layer may use (typed config building, progress lines). They import nothing of
megamemo, and data_pipeline may import them."""
