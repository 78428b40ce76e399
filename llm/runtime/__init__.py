"""What runs inside every training rank around the training loop: joining the process group
(`distributed`), rank liveness (`watchdog`), agreement at rendezvous (`fingerprint`) and watching the
`zerollm launch` that started the rank (`supervisor`)."""
