"""The `megamemo` subcommands: one module per command, each only its argument parsing (the flags several commands
share come from flags.py) and a call into the library (train, eval, plan, export, interop), whose one-line errors
it reports with exit code 2. The dispatcher (megamemo/cli.py) imports a command's module when it is used."""
