"""KSB services: each is `python -m services.<name>`, a thin shell around ksb logic."""
