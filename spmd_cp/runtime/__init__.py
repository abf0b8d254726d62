"""The SPMD runtime: the communicator, agreement on errors, the watchdog, tracing, fault injection."""
