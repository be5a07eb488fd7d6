"""`python -m relay.tools.sink`: the same as `relay sink`."""

import sys

from relay.tools.sink.app import main

sys.exit(main())
