"""Launching runs past one machine: batch scripts for cluster schedulers (`slurm`)."""
