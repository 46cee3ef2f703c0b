"""The `megamemo` subcommands: one module per command, each only its argument parsing (the flags several commands
share, and the flags made from a library request type's fields, come from flags.py) and a call into the library
(train, eval, plan, export, interop). A command catches no errors: the dispatcher (megamemo/cli.py) imports a
command's module when it is used, reports a user error (megamemo.util.errors.MegamemoError) in one line with exit
code 2, and a bug with its traceback and exit code 1."""
