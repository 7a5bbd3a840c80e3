"""Helpers of the training package."""
