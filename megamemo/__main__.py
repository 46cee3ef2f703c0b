import sys

from megamemo.cli import main

sys.exit(main())
