"""Developer scripts (run as `python scripts/NAME.py`); a package so that they can share helpers."""
