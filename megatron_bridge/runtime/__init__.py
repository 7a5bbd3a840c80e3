"""What models/, data/, peft/, inference/ and training/ share, below all of them: the files of a
checkpoint and the config saved with it (`checkpointing`), process groups and the CPU backend
(`distributed`, `cpu_backend`), the launcher's variables as numbers (`launcher_env`), child
processes (`child_processes`), tokenizers (`tokenizers`), the callback protocol (`callbacks`),
the peak throughput of GPUs (`gpu_peaks`), whether a directory can be written (`writable`) and
JSON parsing that reports every malformed input as such (`json_input`). Nothing here imports
those packages."""
