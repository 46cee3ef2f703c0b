"""Using a trained model inside megamemo: `megamemo eval` (evaluate.py, TRAMS selection included), `generate`,
`analyze` (memorizing coefficient, attention by distance) and `plot` (training curves of runs); start_memory.py reads
the memory `eval`/`generate --memory` start from."""
