import sys

from strategies.cli import main

sys.exit(main())
