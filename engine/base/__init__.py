"""What every part of the engine stands on: user errors, units, typed settings, the registry."""
