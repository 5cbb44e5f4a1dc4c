import sys

from spd.cli import main

sys.exit(main())
