"""dataset package."""
