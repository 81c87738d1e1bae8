"""`python -m relayd`: the same as the `relayd` command."""

import sys

from relayd.cli import main

sys.exit(main())
