"""The driver's side, run in the controller's process: `TorchExecutor`, its control socket, failure diagnosis, stage start-up, profiling; reaches a stage only through its entry point."""
