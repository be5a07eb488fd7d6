"""`python -m relay.tools.sink`: the same as `relay sink`."""

import sys

from relay.tools.sink.cli import main

sys.exit(main())
