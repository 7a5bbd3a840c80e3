"""Resiliency: in-process restart, fault tolerance heartbeats, simulated faults, stragglers."""
