import sys

from parsat.cli import main

sys.exit(main())
