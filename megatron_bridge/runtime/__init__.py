"""What models/, data/, peft/, inference/ and training/ share, below all of them: the files of a
checkpoint and the config saved with it (`checkpointing`), process groups and the CPU backend
(`distributed`, `cpu_backend`), child processes (`child_processes`), tokenizers (`tokenizers`)
and the callback protocol (`callbacks`). Nothing here imports those packages."""
