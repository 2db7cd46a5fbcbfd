"""Utilities shared by every stage (device helper, constants, checkpoints, logging, plots)."""
