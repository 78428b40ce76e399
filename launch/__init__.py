"""Starting training processes: `zerollm launch` on many nodes (`launcher`, checked `hostfile`s, typed `options`,
SLURM node lists in `nodelist`, the SLURM template in `slurm/`, torchrun as it is started in `torchrun`, DeepSpeed's
launchers kept quiet where their output's reader left in `deepspeed_launcher`, both started from zerollm's folder by
`own_module`) and
`--nproc N` on one machine (`local`). What crosses to other hosts is made to arrive exactly as typed: `remote_shell`
(quoting for DeepSpeed's pdsh command) and `environment` (the variables DeepSpeed exports). It starts processes only:
what runs inside each rank is `llm.runtime`, and nothing here imports the model or the trainer."""
