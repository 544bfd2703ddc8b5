"""The benchmark program (`make bench`): not a test, not part of the modeld package."""
