"""Starting training processes: today the single-node relaunch behind `--nproc`; multi-node jobs build on it."""
