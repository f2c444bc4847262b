"""The `ksb` command line."""
