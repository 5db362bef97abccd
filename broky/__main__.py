import sys

from broky.cli import main

sys.exit(main())
