"""What a trained model needs to leave aiayn: exports to other inference engines.

Importing this package turns the speed paths on (`aiayn.fast`, through `aiayn.speed`)."""

import aiayn.fast  # noqa: F401  # the speed paths on, for whoever serves through here
