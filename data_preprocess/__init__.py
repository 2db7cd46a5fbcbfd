"""data_preprocess package."""
