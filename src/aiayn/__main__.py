"""`python -m aiayn` (also what torchrun runs with `-m aiayn`)."""

import sys

try:
    from aiayn.cli import main
except KeyboardInterrupt:  # Ctrl-C while importing: one line, as anywhere else
    sys.stderr.write("aiayn: interrupted (Ctrl-C): stopped before any work\n")
    sys.exit(130)

sys.exit(main())
