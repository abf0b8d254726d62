"""What every front end (the command line, cli/; the HTTP server, server/) needs around the
engine: prompts held to the context, the memory forecast checked, whether to shard the
weights, and the per-rank figures a summary reports."""
