"""`python -m aiayn` (also what torchrun runs with `-m aiayn`)."""

import sys

from aiayn.cli import main

sys.exit(main())
