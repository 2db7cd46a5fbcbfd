"""optimizer package."""
