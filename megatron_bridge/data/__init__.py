"""Datasets, samplers and dataloaders: turn a finalized dataset config into micro-batch iterators."""
