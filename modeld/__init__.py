"""modeld: a local daemon that keeps a coding tool's long, stable prompt prefix warm."""
