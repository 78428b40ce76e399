"""Starting training processes: `zerollm launch` on many nodes (`launcher`, checked `hostfile`s, typed
`options`, the SLURM template in `slurm/`) and `--nproc N` on one machine (`local`). It starts processes only:
what runs inside each rank is `llm.runtime`, and nothing here imports the model or the trainer."""
